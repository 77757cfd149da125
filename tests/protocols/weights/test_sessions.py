"""A session belongs to one sender and one receiver: no other peer is ever handed its frames.

Real processes. A receiver whose session failed on the sender's side (an engine stuck in
on_bucket past the ACK deadline) stays alive while the trainer rebuilds its sender on the same
endpoint and a new receiver connects: the rebuilt pair must work, and the stale receiver must
see nothing of the new session. A second receiver on an endpoint gets no frame of a session it
did not join. An invitation left queued by a sender that has gone is skipped, not joined.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import zmq

from tests.conftest import socket_files
from tests.protocols.weights.peer import digest, make_weights
from tests.protocols.weights.peers import Peer, endpoint, first_to_speak, wait_until
from timeshare.errors import AckTimeout, ProtocolError
from timeshare.protocols.weights import (
    TransferConfig,
    WeightReceiver,
    WeightSender,
    frames,
    sweep_stale,
)
from timeshare.protocols.weights.sender import ABORT_NOTICE_S
from timeshare.runtime import Endpoint

ACK_TIMEOUT_S = 2.0
CFG: dict[str, Any] = {
    "bucket_mb": 0.25,
    "ack_timeout_s": ACK_TIMEOUT_S,
    "handshake_timeout_s": 30.0,
    "begin_timeout_s": 60.0,
}
WEIGHTS = "mb:2:0.125"  # 16 tensors of 128 KiB: 8 buckets of 0.25 MiB


def digests(spec: str, seed: int) -> dict[str, list[Any]]:
    return {name: digest(tensor) for name, tensor in make_weights(spec, seed).items()}


def connections_to(bound: Endpoint) -> int:
    """How many peers are connected to the socket a sender bound (its accepted connections)."""
    if bound.path is not None:
        # An accepted UNIX socket carries its listener's path; the listener is one more line.
        with open("/proc/net/unix") as table:
            lines = [line.split() for line in table.read().splitlines()[1:]]
        return sum(1 for fields in lines if fields[-1] == str(bound.path)) - 1
    return sum(
        1
        for conn in psutil.net_connections(kind="tcp")
        if conn.laddr and conn.laddr.port == bound.port and conn.status == "ESTABLISHED"
    )


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as peers:
        yield peers


@pytest.mark.asyncio
async def test_a_rebuilt_pair_works_while_the_stale_receiver_lives(runtime_dir: Path) -> None:
    url = endpoint(runtime_dir)
    unstick = runtime_dir / "engine-may-return"
    go = runtime_dir / "fresh-receiver-may-start"
    with (
        # The engine is stuck in on_bucket at bucket 1 until the test lets it return.
        Peer(
            role="receiver",
            endpoint=url,
            config=CFG,
            mode="hang_on_bucket",
            bucket=1,
            hang_until=str(unstick),
            hang_s=300.0,
        ) as stale,
        # Started now (imports take a while), connects once `go` exists.
        Peer(role="receiver", endpoint=url, config=CFG, transfers=2, start_when=str(go)) as fresh,
    ):
        stale.wait_ready()
        with WeightSender(url, TransferConfig(**CFG)) as first:
            with pytest.raises(AckTimeout) as timed_out:
                await first.send(make_weights(WEIGHTS, 0), version=1)
        assert (timed_out.value.phase, timed_out.value.bucket) == ("bucket", 1)
        # The trainer rebuilds its sender on the same endpoint and the engine a new receiver,
        # while the stale receiver is still inside on_bucket.
        with WeightSender(url, TransferConfig(**CFG)) as rebuilt:
            go.touch()
            fresh.wait_ready()
            for version in (2, 3):
                report = await rebuilt.send(make_weights(WEIGHTS, version), version=version)
                assert report.buckets == 8
                event = fresh.next_event()
                assert (event["event"], event["version"]) == ("received", version)
                assert event["digests"] == digests(WEIGHTS, version)
            assert fresh.wait() == 0
            assert stale.proc.poll() is None and not stale.has_event()  # still stuck
            # The stale receiver returns from on_bucket, answers into the void and hears
            # nothing more: its session is dead and it never reconnects. No frame of the
            # rebuilt session reached it (that would be a ProtocolError naming the session).
            unstick.touch()
            event = stale.next_event(timeout=4 * ACK_TIMEOUT_S + 30)
            assert (event["event"], event["type"]) == ("error", "AckTimeout"), event
            assert "no frame from the sender in phase bucket (bucket 2" in event["message"]
            assert stale.wait() == 0
    go.unlink()
    unstick.unlink()
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_a_second_receiver_on_the_endpoint_gets_no_frame_of_the_session(
    runtime_dir: Path, stack: ExitStack, transport: str
) -> None:
    url = endpoint(runtime_dir) if transport == "ipc" else "tcp://127.0.0.1:0"
    # The sender binds first and both receivers are seen connected before anything is sent:
    # otherwise one could take a whole transfer alone by chance, and the test prove nothing.
    with WeightSender(url, TransferConfig(**CFG)) as sender:
        url = sender.endpoint.url  # tcp: the port it got
        one = stack.enter_context(Peer(role="receiver", endpoint=url, config=CFG, transfers=2))
        other = stack.enter_context(Peer(role="receiver", endpoint=url, config=CFG, transfers=2))
        one.wait_ready()
        other.wait_ready()
        assert wait_until(lambda: connections_to(sender.endpoint) == 2, timeout=30.0)
        await sender.send(make_weights(WEIGHTS, 1), version=1)
        # One receiver took the session; the other is still at the endpoint.
        assert wait_until(lambda: connections_to(sender.endpoint) == 1, timeout=10.0)
        assert connections_to(sender.session_endpoint) == 1
        await sender.send(make_weights(WEIGHTS, 2), version=2)
    # Exactly one receiver took the session and got every bucket of both transfers.
    taken = first_to_speak([one, other])
    idle = other if taken is one else one
    events = [taken.next_event(), taken.next_event()]
    assert [(e["event"], e["version"]) for e in events] == [("received", 1), ("received", 2)]
    assert [e["digests"] for e in events] == [digests(WEIGHTS, 1), digests(WEIGHTS, 2)]
    assert taken.wait() == 0
    # The other one is still waiting for a session of its own, silent: a new sender gets it.
    assert idle.proc.poll() is None and not idle.has_event()
    with WeightSender(url, TransferConfig(**CFG)) as sender:
        await sender.send(make_weights(WEIGHTS, 7), version=7)
    event = idle.next_event()
    assert (event["event"], event["version"]) == ("received", 7)
    assert event["digests"] == digests(WEIGHTS, 7)
    assert sweep_stale(runtime_dir) == [] and socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_an_invitation_of_a_sender_that_has_gone_is_skipped(runtime_dir: Path) -> None:
    url = endpoint(runtime_dir)
    may_receive = runtime_dir / "receive-now"
    short = TransferConfig(**{**CFG, "handshake_timeout_s": 1.0})
    # Connected to the endpoint, not yet receiving: an invitation waits in its queue.
    with Peer(role="receiver", endpoint=url, config=CFG, receive_when=str(may_receive)) as receiver:
        receiver.wait_ready()
        with WeightSender(url, short) as gone:
            with pytest.raises(AckTimeout, match=r"phase joined .* the receiver did not answer"):
                await gone.send(make_weights(WEIGHTS, 0), version=1)
        # A new sender on the endpoint; the receiver reads the old invitation first, finds its
        # socket gone, answers it (the new sender drops that answer as not its own) and joins
        # the new session.
        with WeightSender(url, TransferConfig(**CFG)) as sender:
            may_receive.touch()
            report = await sender.send(make_weights(WEIGHTS, 2), version=2)
        assert report.buckets == 8
        event = receiver.next_event()
        assert (event["event"], event["version"]) == ("received", 2)
        assert event["digests"] == digests(WEIGHTS, 2)
        assert "sync.invitation.stale" in receiver.stderr()
    may_receive.unlink()
    assert socket_files(runtime_dir) == []


def test_an_invitation_to_nowhere_is_answered_and_the_receiver_waits_on(
    runtime_dir: Path, rogue_sender: zmq.Socket[bytes]
) -> None:
    with WeightReceiver(endpoint(runtime_dir), TransferConfig(**CFG)) as receiver:
        rogue_sender.send(frames.encode(frames.Invite(frames.PROTOCOL_VERSION, 42)))
        with pytest.raises(AckTimeout, match=r"phase begin .*within 2 s"):
            receiver.receive(lambda items: None, timeout_s=2.0)
    assert rogue_sender.poll(5000), "the receiver must answer the invitation"
    reply = frames.decode_reply(rogue_sender.recv())
    assert isinstance(reply, frames.Failure) and reply.type == "PeerClosed"
    assert "session 2a is gone" in reply.message


def test_an_invitation_to_port_zero_is_a_protocol_error(runtime_dir: Path) -> None:
    context = zmq.Context()
    rogue = context.socket(zmq.REQ)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        with WeightReceiver(f"tcp://127.0.0.1:{port}", TransferConfig(**CFG)) as receiver:
            rogue.send(frames.encode(frames.Invite(frames.PROTOCOL_VERSION, 42, port=0)))
            with pytest.raises(ProtocolError, match="invitation to no usable socket"):
                receiver.receive(lambda items: None, timeout_s=10.0)
        assert rogue.poll(5000)
        reply = frames.decode_reply(rogue.recv())
        assert isinstance(reply, frames.Failure) and reply.type == "ProtocolError"
    finally:
        rogue.close()
        context.term()


@pytest.mark.asyncio
async def test_a_sender_cancelled_before_anyone_joined_stops_at_once(runtime_dir: Path) -> None:
    # No receiver: nobody could hear an abort notice, so none is waited for (it used to wait
    # its whole 5 s bound, shielded from the cancellation).
    with WeightSender(endpoint(runtime_dir), TransferConfig(**CFG)) as sender:
        started = time.monotonic()
        with anyio.move_on_after(0.5):
            await sender.send({"w": make_weights(WEIGHTS, 0)["layer0.weight"]}, version=0)
        assert time.monotonic() - started < ABORT_NOTICE_S - 1.0
    assert socket_files(runtime_dir) == []
