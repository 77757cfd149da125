"""One session, several receivers: an engine's tensor-parallel workers each load every bucket.

Real processes: the receivers (members 0 and 1 of a session) each run in their own process,
the sender in the test. Each bucket is packed once into staging that both map; a buffer is
reused only once every member has ACKed it; staging's names go once both have mapped it;
FINALIZED is reached once both have finalized; a member that fails (in finalize too, the other
done), dies or stays silent ends the session for all, named, within the deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.conftest import socket_files, staging_segments
from tests.protocols.weights.peer import digest, make_weights
from tests.protocols.weights.peers import Peer, endpoint
from timeshare.errors import AckTimeout, PeerError, TransferError
from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender, frames
from timeshare.runtime import Endpoint

ACK_TIMEOUT_S = 8.0
CFG: dict[str, Any] = {
    "bucket_mb": 0.25,
    "pipeline_depth": 2,
    "ack_timeout_s": ACK_TIMEOUT_S,
    "handshake_timeout_s": 30.0,
    "begin_timeout_s": 60.0,
    "checksum": True,
}
WEIGHTS = "mb:2:0.125"  # 16 tensors of 128 KiB: 8 buckets of 0.25 MiB
FINALIZE_S = 2.0  # how long a slow member takes to finalize


def digests(spec: str, seed: int) -> dict[str, list[Any]]:
    return {name: digest(tensor) for name, tensor in make_weights(spec, seed).items()}


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as peers:
        yield peers


def members(
    stack: ExitStack, url: str, count: int, per_member: dict[int, dict[str, Any]] | None = None
) -> list[Peer]:
    """`count` receiver processes, member k of `count` each, all ready; `per_member[k]`: member
    k's arguments (a fault; default: three clean transfers)."""
    per_member = per_member or {}
    peers = [
        stack.enter_context(
            Peer(
                role="receiver",
                endpoint=url,
                config=CFG,
                member=k,
                members=count,
                **per_member.get(k, {"transfers": 3}),
            )
        )
        for k in range(count)
    ]
    for peer in peers:
        peer.wait_ready()
    return peers


@pytest.mark.asyncio
async def test_every_member_gets_every_version_bit_for_bit(
    runtime_dir: Path, stack: ExitStack
) -> None:
    url = endpoint(runtime_dir)
    peers = members(stack, url, 2)
    with WeightSender(url, TransferConfig(**CFG), receivers=2) as sender:
        for version in (1, 2, 3):
            report = await sender.send(make_weights(WEIGHTS, version), version=version)
            assert (report.buckets, report.checksummed) == (8, 8)
            for peer in peers:
                event = peer.next_event()
                assert (event["event"], event["version"]) == ("received", version), event
                assert event["digests"] == digests(WEIGHTS, version)
                assert event["buckets"] == 8 and event["bytes"] == report.bytes
            # Each bucket went into one of the session's two buffers, named only until both
            # members had mapped them.
            assert sender.staging_buffers == 2
            assert staging_segments(runtime_dir) == set()
    for peer in peers:
        assert peer.wait() == 0
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_a_buffer_is_reused_only_after_every_member_acked_it(
    runtime_dir: Path, stack: ExitStack
) -> None:
    """Member 1 sits in bucket 1 for a while before reading it; with two buffers, bucket 3
    goes where bucket 1 was. Had the sender reused that buffer on member 0's ACK alone,
    member 1 would read bucket 3's bytes under bucket 1's names."""
    url = endpoint(runtime_dir)
    slow: dict[str, Any] = {"transfers": 1, "mode": "hang_on_bucket", "bucket": 1, "hang_s": 1.5}
    peers = members(stack, url, 2, {0: {"transfers": 1}, 1: slow})
    with WeightSender(url, TransferConfig(**CFG), receivers=2) as sender:
        started = time.monotonic()
        await sender.send(make_weights(WEIGHTS, 7), version=7)
        assert time.monotonic() - started >= 1.5  # the sender waited for the slow member
    for peer in peers:
        event = peer.next_event()
        assert event["event"] == "received", event
        assert event["digests"] == digests(WEIGHTS, 7)


@pytest.mark.asyncio
async def test_a_member_that_fails_ends_the_session_for_all_naming_it(
    runtime_dir: Path, stack: ExitStack
) -> None:
    url = endpoint(runtime_dir)
    fails: dict[str, Any] = {"transfers": 1, "mode": "raise_on_bucket", "bucket": 2}
    peers = members(stack, url, 2, {0: {"transfers": 1}, 1: fails})
    with WeightSender(url, TransferConfig(**CFG), receivers=2) as sender:
        with pytest.raises(PeerError, match=r"receiver 1 of 2 .* failed \(bucket") as failed:
            await sender.send(make_weights(WEIGHTS, 1), version=1)
    assert "engine failed to load bucket 2" in failed.value.remote_message
    event = peers[1].next_event()
    assert (event["event"], event["type"]) == ("error", "RuntimeError"), event
    # Member 0, still listening, was told the transfer was given up: at once, not after its
    # own deadline.
    event = peers[0].next_event(timeout=ACK_TIMEOUT_S)
    assert (event["event"], event["type"]) == ("error", "TransferError"), event
    assert "sender aborted the transfer of version 1" in event["message"]
    assert "receiver 1 of 2" in event["message"]
    for peer in peers:
        assert peer.wait() == 0
    assert socket_files(runtime_dir) == [] and staging_segments(runtime_dir) == set()


@pytest.mark.asyncio
async def test_finalized_waits_for_the_member_that_finalizes_last(
    runtime_dir: Path, stack: ExitStack
) -> None:
    """Member 0 finalizes at once, member 1 takes FINALIZE_S: the sender returns only once
    both have (its FINALIZED wait spans member 1's), each holding the version whole. Had it
    returned on member 0's FINALIZED, its finalize would have lasted a moment."""
    url = endpoint(runtime_dir)
    slow: dict[str, Any] = {"transfers": 1, "mode": "slow_finalize", "finalize_sleep_s": FINALIZE_S}
    peers = members(stack, url, 2, {0: {"transfers": 1}, 1: slow})
    with WeightSender(url, TransferConfig(**CFG), receivers=2) as sender:
        report = await sender.send(make_weights(WEIGHTS, 5), version=5)
    finalize_s = sum(span.seconds for span in report.spans if span.name == "finalize")
    assert finalize_s >= FINALIZE_S, report.spans
    for peer in peers:
        event = peer.next_event()
        assert event["event"] == "received", event
        assert (event["version"], event["digests"]) == (5, digests(WEIGHTS, 5))


@pytest.mark.asyncio
async def test_a_member_failing_in_finalize_fails_the_transfer_the_other_finalized(
    runtime_dir: Path, stack: ExitStack
) -> None:
    """Member 0 finalizes at once; member 1's post-load processing raises after FINALIZE_S.
    The sender waits past member 0's FINALIZED for member 1's answer, and fails naming it."""
    url = endpoint(runtime_dir)
    fails: dict[str, Any] = {
        "transfers": 1,
        "mode": "slow_raise_in_finalize",
        "finalize_sleep_s": FINALIZE_S,
    }
    peers = members(stack, url, 2, {0: {"transfers": 1}, 1: fails})
    with WeightSender(url, TransferConfig(**CFG), receivers=2) as sender:
        started = time.monotonic()
        with pytest.raises(PeerError, match=r"receiver 1 of 2 .* failed") as failed:
            await sender.send(make_weights(WEIGHTS, 1), version=1)
        assert time.monotonic() - started >= FINALIZE_S
    assert failed.value.remote_type == "ValueError"
    assert "post-load processing failed" in failed.value.remote_message
    event = peers[0].next_event()
    assert (event["event"], event["version"]) == ("received", 1), event
    event = peers[1].next_event()
    assert (event["event"], event["type"]) == ("error", "ValueError"), event
    for peer in peers:
        assert peer.wait() == 0
    assert socket_files(runtime_dir) == [] and staging_segments(runtime_dir) == set()


@pytest.mark.asyncio
async def test_a_member_killed_mid_transfer_is_an_ack_timeout_naming_it(
    runtime_dir: Path, stack: ExitStack
) -> None:
    url = endpoint(runtime_dir)
    dies: dict[str, Any] = {"transfers": 1, "mode": "kill_on_bucket", "bucket": 3}
    peers = members(stack, url, 2, {0: {"transfers": 1}, 1: dies})
    with WeightSender(url, TransferConfig(**CFG), receivers=2) as sender:
        started = time.monotonic()
        with pytest.raises(AckTimeout, match="from receiver 1 of 2") as timed_out:
            await sender.send(make_weights(WEIGHTS, 1), version=1)
        assert time.monotonic() - started < ACK_TIMEOUT_S + 10
    assert (timed_out.value.phase, timed_out.value.bucket) == ("bucket", 3)
    # Member 0 waits for bucket 4 from the moment it ACKed bucket 3, the sender for member 1's
    # ACK of bucket 3 from about then: member 0 either hears the abort or ends on its own
    # deadline a moment later; either way within the channel's deadlines, never a hang.
    event = peers[0].next_event(timeout=ACK_TIMEOUT_S)
    assert (event["event"], event["type"]) in {("error", "TransferError"), ("error", "AckTimeout")}
    assert peers[1].wait() != 0
    assert socket_files(runtime_dir) == [] and staging_segments(runtime_dir) == set()


@pytest.mark.asyncio
async def test_a_member_that_never_joins_fails_the_handshake_naming_it(
    runtime_dir: Path, stack: ExitStack
) -> None:
    url = endpoint(runtime_dir)
    config = TransferConfig(**{**CFG, "handshake_timeout_s": 3.0})
    member0 = stack.enter_context(  # member 1 of 2 never comes
        Peer(role="receiver", endpoint=url, config=CFG, member=0, members=2, transfers=1)
    )
    member0.wait_ready()
    with WeightSender(url, config, receivers=2) as sender:
        with pytest.raises(AckTimeout, match=r"phase joined .* from receiver 1 of 2"):
            await sender.send(make_weights(WEIGHTS, 1), version=1)
    event = member0.next_event(timeout=ACK_TIMEOUT_S)
    assert (event["event"], event["type"]) == ("error", "TransferError"), event
    assert socket_files(runtime_dir) == [] and staging_segments(runtime_dir) == set()


@pytest.mark.asyncio
async def test_a_receiver_set_up_for_another_size_refuses_the_invitation(
    runtime_dir: Path, stack: ExitStack
) -> None:
    """An engine that thinks it has one worker where the sender sends to two (or the other way
    round) is a clear error on both sides, never a session half joined."""
    url = endpoint(runtime_dir)
    alone = stack.enter_context(Peer(role="receiver", endpoint=url, config=CFG, transfers=1))
    alone.wait_ready()
    with WeightSender(url, TransferConfig(**CFG), receivers=2) as sender:
        with pytest.raises(PeerError, match="disagree on the tensor-parallel size"):
            await sender.send(make_weights(WEIGHTS, 1), version=1)
    event = alone.next_event()
    assert (event["event"], event["type"]) == ("error", "ProtocolError"), event
    assert "invitation for receiver 0 of 2, this one is receiver 0 of 1" in event["message"]
    assert socket_files(runtime_dir) == []


def test_one_receiver_keeps_the_wire_of_a_single_pair() -> None:
    """The members fields are left out of a one-receiver invitation: an older receiver reads it
    as it always did, and the frame is what it was."""
    invite = frames.encode(frames.Invite(frames.PROTOCOL_VERSION, 5))
    assert msgspec.msgpack.decode(invite) == {"kind": "invite", "protocol": 2, "session": 5}
    two = frames.decode_request(frames.encode(frames.Invite(frames.PROTOCOL_VERSION, 5, 0, 1, 2)))
    assert isinstance(two, frames.Invite) and (two.member, two.members) == (1, 2)


def test_member_endpoints() -> None:
    ipc = Endpoint.parse("ipc:///tmp/ts-x/w-rank3.sock")
    assert ipc.member(0) == ipc
    assert ipc.member(2).url == "ipc:///tmp/ts-x/w-rank3.sock.m2"
    tcp = Endpoint.parse("tcp://127.0.0.1:4100")
    assert tcp.member(3).url == "tcp://127.0.0.1:4103"
    with pytest.raises(TransferError, match="fixed port"):
        Endpoint.parse("tcp://127.0.0.1:0").member(1)
    with pytest.raises(TransferError, match="leaves no room for member 1"):
        Endpoint.parse("ipc:///" + "d" * 103 + ".s").member(1)


def test_bad_member_numbers_are_refused() -> None:
    with pytest.raises(TransferError, match="member 2 of 2 does not exist"):
        WeightReceiver("ipc:///tmp/ts-none/w.sock", member=2, members=2)
    with pytest.raises(TransferError, match="at least one receiver"):
        WeightSender("ipc:///tmp/ts-none/w.sock", receivers=0)
