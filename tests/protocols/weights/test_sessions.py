"""A session belongs to one sender and one receiver: no other peer is ever handed its frames.

Real processes: a receiver whose session failed on the sender's side (an engine stuck in
on_bucket past the ACK deadline) stays alive while the trainer rebuilds its sender on the same
endpoint and a new receiver connects; the rebuilt pair must work, and the stale receiver must
see nothing of the new session.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import socket_files
from tests.protocols.weights.peer import digest, make_weights
from tests.protocols.weights.peers import Peer, first_to_speak
from timeshare.errors import AckTimeout
from timeshare.protocols.weights import TransferConfig, WeightSender, sweep_stale

ACK_TIMEOUT_S = 2.0
CFG: dict[str, Any] = {
    "bucket_mb": 0.25,
    "ack_timeout_s": ACK_TIMEOUT_S,
    "handshake_timeout_s": 30.0,
    "begin_timeout_s": 30.0,
}
WEIGHTS = "mb:2:0.125"  # 16 tensors of 128 KiB: 8 buckets of 0.25 MiB


def endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir}/w-rank0.sock"


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as peers:
        yield peers


def digests(spec: str, seed: int) -> dict[str, list[Any]]:
    return {name: digest(tensor) for name, tensor in make_weights(spec, seed).items()}


@pytest.mark.asyncio
async def test_a_rebuilt_pair_works_while_the_stale_receiver_lives(runtime_dir: Path) -> None:
    url = endpoint(runtime_dir)
    weights = make_weights(WEIGHTS, 0)
    # The engine is stuck in on_bucket at bucket 1 for longer than the ACK deadline.
    stuck_s = 5 * ACK_TIMEOUT_S
    go = runtime_dir / "fresh-receiver-may-start"
    with (
        Peer(
            role="receiver",
            endpoint=url,
            config=CFG,
            mode="hang_on_bucket",
            bucket=1,
            hang_s=stuck_s,
        ) as stale,
        Peer(role="receiver", endpoint=url, config=CFG, transfers=2, start_when=str(go)) as fresh,
    ):
        stale.wait_ready()
        with WeightSender(url, TransferConfig(**CFG)) as first:
            with pytest.raises(AckTimeout) as timed_out:
                await first.send(weights, version=1)
        assert (timed_out.value.phase, timed_out.value.bucket) == ("bucket", 1)
        # The trainer rebuilds its sender on the same endpoint and the engine a new receiver,
        # while the stale receiver is still inside on_bucket (and its socket would reconnect).
        started = time.monotonic()
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
            # Both transfers ran while the stale receiver was still stuck (it had been for
            # ACK_TIMEOUT_S when `started` was taken): the test saw the case it is about.
            assert time.monotonic() - started < stuck_s - ACK_TIMEOUT_S
            # The stale receiver wakes up, answers into the void and hears nothing more: its
            # session is dead. It never got a frame of the rebuilt session.
            event = stale.next_event(timeout=stuck_s + 4 * ACK_TIMEOUT_S + 30)
            assert (event["event"], event["type"]) == ("error", "AckTimeout"), event
            assert "no frame from the sender in phase bucket (bucket 2" in event["message"]
            assert stale.wait() == 0
    go.unlink()
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_a_second_receiver_on_the_endpoint_gets_no_frame_of_the_session(
    runtime_dir: Path, stack: ExitStack
) -> None:
    url = endpoint(runtime_dir)
    # The sender binds first, so that both receivers are connected before anything is sent
    # (a receiver that started first would back off up to a second between reconnects, and the
    # other could take a whole transfer alone by chance).
    with WeightSender(url, TransferConfig(**CFG)) as sender:
        one = stack.enter_context(Peer(role="receiver", endpoint=url, config=CFG, transfers=2))
        other = stack.enter_context(Peer(role="receiver", endpoint=url, config=CFG, transfers=2))
        one.wait_ready()
        other.wait_ready()
        await anyio.sleep(0.5)  # their connects complete within milliseconds of `ready`
        for version in (1, 2):
            await sender.send(make_weights(WEIGHTS, version), version=version)
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
async def test_a_session_over_tcp_works_and_stays_its_own(runtime_dir: Path) -> None:
    url = "tcp://127.0.0.1:0"
    with WeightSender(url, TransferConfig(**CFG)) as sender:
        bound = sender.endpoint.url
        assert not bound.endswith(":0")
        with Peer(role="receiver", endpoint=bound, config=CFG, transfers=2) as peer:
            peer.wait_ready()
            for version in (1, 2):
                await sender.send(make_weights(WEIGHTS, version), version=version)
                assert peer.next_event()["digests"] == digests(WEIGHTS, version)
            assert peer.wait() == 0
