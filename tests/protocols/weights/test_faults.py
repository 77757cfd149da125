"""Faults of the weight channel with real processes: never a hang, never a leak.

Each test asserts the error type and message on both sides, and (through the autouse fixture
and `socket_files`) that no staging segment and no socket file is left.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from tests.conftest import socket_files, staging_segments
from tests.protocols.weights.peer import make_weights
from tests.protocols.weights.peers import Peer, endpoint, wait_until
from timeshare.errors import AckTimeout, PeerError, ProtocolError, SessionClosed
from timeshare.protocols.weights import (
    TransferConfig,
    WeightReceiver,
    WeightSender,
    frames,
    sweep_stale,
)

ACK_TIMEOUT_S = 2.0
FAST: dict[str, Any] = {
    "bucket_mb": 0.25,
    "ack_timeout_s": ACK_TIMEOUT_S,
    "handshake_timeout_s": 20.0,
    "finalize_timeout_s": ACK_TIMEOUT_S,
}
WEIGHTS = "mb:2:0.125"  # 16 tensors of 128 KiB, two to a 0.25 MiB bucket, views of staging


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("mode", "remote_type", "remote_message"),
    [
        ("raise_on_bucket", "RuntimeError", "engine failed to load bucket 1"),
        ("raise_in_finalize", "ValueError", "post-load processing failed"),
        ("keep_view", "TransferError", "on_bucket kept tensors that view staging buffer 1"),
    ],
)
async def test_receiver_failure_reaches_the_sender_as_peer_error(
    runtime_dir: Path, mode: str, remote_type: str, remote_message: str
) -> None:
    with Peer(
        role="receiver", endpoint=endpoint(runtime_dir), config=FAST, mode=mode, bucket=1
    ) as peer:
        peer.wait_ready()
        sender = WeightSender(endpoint(runtime_dir), TransferConfig(**FAST))
        with pytest.raises(PeerError, match=remote_message) as info:
            await sender.send(make_weights(WEIGHTS, 0), version=1)
        assert info.value.remote_type == remote_type
        assert remote_message in info.value.remote_message
        # The receiver re-raised its own exception.
        event = peer.next_event()
        assert (event["event"], event["type"]) == ("error", remote_type)
        assert remote_message in event["message"]
        assert peer.wait() == 0
        # The session is closed on the sender's side: a new pair is needed.
        with pytest.raises(SessionClosed):
            await sender.send({"w": torch.ones(1)}, version=2)
        sender.close()
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["kill_on_bucket", "hang_on_bucket"])
async def test_dead_or_stuck_receiver_is_an_ack_timeout(runtime_dir: Path, mode: str) -> None:
    with Peer(
        role="receiver", endpoint=endpoint(runtime_dir), config=FAST, mode=mode, bucket=2
    ) as peer:
        peer.wait_ready()
        with WeightSender(endpoint(runtime_dir), TransferConfig(**FAST)) as sender:
            started = time.monotonic()
            with pytest.raises(AckTimeout) as info:
                await sender.send(make_weights(WEIGHTS, 0), version=1)
            elapsed = time.monotonic() - started
        assert (info.value.phase, info.value.bucket) == ("bucket", 2)
        assert info.value.seq is not None and info.value.seq >= 3
        assert info.value.endpoint == endpoint(runtime_dir)
        assert endpoint(runtime_dir) in str(info.value)
        assert "phase bucket (bucket 2, seq" in str(info.value)
        assert elapsed < ACK_TIMEOUT_S + 3.0  # the bucket's wait, plus a little
        if mode == "kill_on_bucket":
            assert peer.wait() == -signal.SIGKILL
    assert socket_files(runtime_dir) == []


def test_dead_sender_is_an_ack_timeout_on_the_receiver(runtime_dir: Path) -> None:
    with Peer(
        role="sender",
        endpoint=endpoint(runtime_dir),
        config=FAST,
        spec=WEIGHTS,
        kill_after_tensors=5,
    ) as peer:
        peer.wait_ready()
        with WeightReceiver(endpoint(runtime_dir), TransferConfig(**FAST)) as receiver:
            started = time.monotonic()
            with pytest.raises(AckTimeout) as info:
                receiver.receive(lambda items: None)
            elapsed = time.monotonic() - started
            assert peer.wait() == -signal.SIGKILL
        # Five tensors of 128 KiB make two full buckets; the third never comes.
        assert (info.value.phase, info.value.bucket) == ("bucket", 2)
        assert "no frame from the sender in phase bucket (bucket 2" in str(info.value)
        assert elapsed < 0.2 + 2 * ACK_TIMEOUT_S + 3.0
        with pytest.raises(SessionClosed):
            receiver.receive(lambda items: None)
    # The killed sender's staging had been unlinked at the handshake; its socket files (the
    # endpoint and the session's own) are left (libzmq never removes one) until a sweep.
    left = sorted(str(p) for p in socket_files(runtime_dir))
    assert [Path(p).name.split(".sock")[0] for p in left] == ["w-rank0", "w-rank0"]
    assert sorted(sweep_stale(runtime_dir)) == left
    assert socket_files(runtime_dir) == []


def test_sweep_removes_staging_of_a_sender_killed_before_the_handshake(runtime_dir: Path) -> None:
    # No receiver: the sender creates its named staging, then waits for the handshake's ACK.
    before = staging_segments(runtime_dir)
    cfg: dict[str, Any] = {**FAST, "handshake_timeout_s": 60.0}
    with Peer(role="sender", endpoint=endpoint(runtime_dir), config=cfg, spec=WEIGHTS) as peer:
        pid = peer.wait_ready()
        assert wait_until(lambda: len(staging_segments(runtime_dir) - before) == 2)
        left = sorted(staging_segments(runtime_dir) - before)
        assert all(f"-{pid}-" in name for name in left)
        # The owner lives: nothing is swept.
        assert sweep_stale(runtime_dir) == []
        peer.kill()
    assert staging_segments(runtime_dir) - before == set(left)
    sockets = [str(p) for p in socket_files(runtime_dir)]  # the endpoint and the session's
    assert len(sockets) == 2 and f"{runtime_dir}/w-rank0.sock" in sockets
    removed = sweep_stale(runtime_dir)
    assert sorted(removed) == sorted([*(f"/dev/shm/{n}" for n in left), *sockets])
    assert staging_segments(runtime_dir) - before == set()


def test_sweep_leaves_other_runtime_directories_alone(runtime_dir: Path, tmp_path: Path) -> None:
    other = Path(os.path.realpath(tmp_path))
    cfg: dict[str, Any] = {**FAST, "handshake_timeout_s": 60.0}
    before = staging_segments(runtime_dir)
    with Peer(role="sender", endpoint=endpoint(runtime_dir), config=cfg, spec=WEIGHTS) as peer:
        peer.wait_ready()
        assert wait_until(lambda: len(staging_segments(runtime_dir) - before) == 2)
        peer.kill()
    assert sweep_stale(other) == []
    assert len(sweep_stale(runtime_dir)) == 4  # two segments, two socket files


@pytest.mark.asyncio
async def test_slow_finalize_is_a_timeout_on_both_sides(runtime_dir: Path) -> None:
    cfg: dict[str, Any] = {**FAST, "finalize_timeout_s": 1.0}
    with Peer(
        role="receiver",
        endpoint=endpoint(runtime_dir),
        config=cfg,
        mode="slow_finalize",
        finalize_sleep_s=2.5,
    ) as peer:
        peer.wait_ready()
        with WeightSender(endpoint(runtime_dir), TransferConfig(**cfg)) as sender:
            with pytest.raises(AckTimeout) as info:
                await sender.send(make_weights(WEIGHTS, 0), version=1)
        assert info.value.phase == "finalized"
        event = peer.next_event()
        assert event["type"] == "TransferError"
        assert "finalize took" in event["message"]


def test_malformed_frame_to_the_receiver_is_a_protocol_error(
    runtime_dir: Path, rogue_sender: zmq.Socket[bytes]
) -> None:
    with WeightReceiver(endpoint(runtime_dir), TransferConfig(**FAST)) as receiver:
        rogue_sender.send(b"\x93not a frame")
        with pytest.raises(ProtocolError, match="malformed request frame"):
            receiver.receive(lambda items: None)
    assert rogue_sender.poll(5000), "the receiver must still reply"
    reply = frames.decode_reply(rogue_sender.recv())
    assert isinstance(reply, frames.Failure) and reply.type == "ProtocolError"


def test_foreign_protocol_version_is_named(
    runtime_dir: Path, rogue_sender: zmq.Socket[bytes]
) -> None:
    with WeightReceiver(endpoint(runtime_dir), TransferConfig(**FAST)) as receiver:
        rogue_sender.send(frames.encode(frames.Goodbye(protocol=99, session=1)))
        with pytest.raises(ProtocolError, match="protocol 99"):
            receiver.receive(lambda items: None)


def test_frame_of_another_session_is_a_protocol_error(
    runtime_dir: Path, rogue_sender: zmq.Socket[bytes]
) -> None:
    with WeightReceiver(endpoint(runtime_dir), TransferConfig(**FAST)) as receiver:
        rogue_sender.send(frames.encode(frames.Finalize(frames.PROTOCOL_VERSION, 42, 0, 1)))
        with pytest.raises(ProtocolError, match="frame of session 2a, this session is none yet"):
            receiver.receive(lambda items: None)
    assert rogue_sender.poll(5000)
    assert isinstance(frames.decode_reply(rogue_sender.recv()), frames.Failure)


@pytest.mark.asyncio
async def test_garbage_ack_is_a_protocol_error_on_the_sender(runtime_dir: Path) -> None:
    url = endpoint(runtime_dir)
    context = zmq.Context()
    rogue = context.socket(zmq.REP)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(url)
    try:
        with WeightSender(url, TransferConfig(**FAST)) as sender:

            def answer_with_garbage() -> None:
                if rogue.poll(10_000):
                    rogue.recv()
                    rogue.send(b"\xc1")

            thread = threading.Thread(target=answer_with_garbage)
            thread.start()
            with pytest.raises(ProtocolError, match="malformed reply frame"):
                await sender.send({"w": torch.ones(3)}, version=1)
            thread.join(10)
    finally:
        rogue.close()
        context.term()
    assert socket_files(runtime_dir) == []


def test_second_sender_on_a_live_endpoint_is_refused(runtime_dir: Path) -> None:
    from timeshare.errors import TransferError

    with WeightSender(endpoint(runtime_dir), TransferConfig(**FAST)):
        with pytest.raises(TransferError, match="bound by a live process"):
            WeightSender(endpoint(runtime_dir), TransferConfig(**FAST))
    assert socket_files(runtime_dir) == []


def test_a_stale_socket_file_is_replaced_at_bind(runtime_dir: Path) -> None:
    import socket as pysocket

    from timeshare.runtime import socket_is_live

    path = runtime_dir / "w-rank0.sock"
    dead = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, as after a SIGKILL
    assert socket_files(runtime_dir) == [path]
    with WeightSender(endpoint(runtime_dir), TransferConfig(**FAST)) as sender:
        assert path in socket_files(runtime_dir)
        assert socket_is_live(path)  # the stale file was replaced by the sender's own
        assert sender.session_endpoint.path in socket_files(runtime_dir)
    assert socket_files(runtime_dir) == []


def test_a_regular_file_at_the_endpoint_is_not_touched(runtime_dir: Path) -> None:
    from timeshare.errors import TransferError

    path = runtime_dir / "w-rank0.sock"
    path.write_text("not a socket")
    with pytest.raises(TransferError, match="exists and is not a socket"):
        WeightSender(endpoint(runtime_dir), TransferConfig(**FAST))
    assert path.read_text() == "not a socket"
    path.unlink()


@pytest.mark.asyncio
async def test_close_is_refused_while_a_transfer_runs(runtime_dir: Path) -> None:
    import anyio

    from timeshare.errors import TransferError

    with WeightSender(endpoint(runtime_dir), TransferConfig(**FAST)) as sender:
        async with anyio.create_task_group() as group:
            # No receiver: the send waits for the handshake until cancelled below. The staging it
            # makes as the handshake begins shows that it runs.
            group.start_soon(partial(sender.send, {"w": torch.ones(2)}, version=0))
            deadline = time.monotonic() + 10.0
            while sender.staging_buffers == 0:
                assert time.monotonic() < deadline, "the send did not begin its handshake in 10 s"
                await anyio.sleep(0.01)
            with pytest.raises(TransferError, match="while a transfer is in progress"):
                sender.close()
            group.cancel_scope.cancel()
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_receive_async_raises_a_timeout_as_itself(runtime_dir: Path) -> None:
    # Issue 11, defect 1: it came wrapped in an ExceptionGroup, so `except AckTimeout` missed it.
    cfg = TransferConfig(**{**FAST, "ack_timeout_s": 1.0, "begin_timeout_s": 1.0})
    with WeightReceiver(endpoint(runtime_dir), cfg) as receiver:
        with pytest.raises(AckTimeout, match=r"no frame from the sender in phase begin") as info:
            await receiver.receive_async(lambda items: None)
    assert "within 1 s" in str(info.value)
    assert info.value.phase == "begin"


@pytest.mark.asyncio
async def test_receive_async_raises_an_on_bucket_error_as_itself(runtime_dir: Path) -> None:
    class EngineRefused(Exception):
        pass

    def refuse(items: list[tuple[str, torch.Tensor]]) -> None:
        raise EngineRefused(f"cannot load {items[0][0]}")

    with Peer(role="sender", endpoint=endpoint(runtime_dir), config=FAST, spec=WEIGHTS) as peer:
        peer.wait_ready()
        with WeightReceiver(endpoint(runtime_dir), TransferConfig(**FAST)) as receiver:
            with pytest.raises(EngineRefused, match=r"cannot load layer0\.weight"):
                await receiver.receive_async(refuse)
        event = peer.next_event()
        assert (event["event"], event["type"]) == ("error", "PeerError")
        assert "EngineRefused: cannot load layer0.weight" in event["message"]
        assert peer.wait() == 0


@pytest.mark.asyncio
async def test_a_sender_without_a_receiver_names_the_deadline_it_armed(runtime_dir: Path) -> None:
    cfg = TransferConfig(**{**FAST, "handshake_timeout_s": 1.0})
    with WeightSender(endpoint(runtime_dir), cfg) as sender:
        with pytest.raises(AckTimeout) as info:
            await sender.send({"w": torch.ones(3)}, version=0)
    assert info.value.phase == "joined"
    assert "within 1 s, no receiver took the invitation" in str(info.value), str(info.value)
    assert socket_files(runtime_dir) == []


def test_a_receive_deadline_that_cannot_work_is_refused(runtime_dir: Path) -> None:
    with WeightReceiver(endpoint(runtime_dir), TransferConfig(**FAST)) as receiver:
        for bad in (float("nan"), float("inf"), 0.0, -1.0):
            with pytest.raises(ValueError, match=f"timeout_s must be .*got {bad}"):
                receiver.receive(lambda items: None, timeout_s=bad)
        # Refused before anything happened: the session is still usable.
        with pytest.raises(AckTimeout):
            receiver.receive(lambda items: None, timeout_s=0.2)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("tcp://127.0.0.1", "tcp endpoint must be tcp://host:port"),
        ("tcp://127.0.0.1:99999", "tcp endpoint must be tcp://host:port"),
        ("tcp://:5555", "tcp endpoint must be tcp://host:port"),
        ("tcp://127.0.0.1:\u00b2", "tcp endpoint must be tcp://host:port"),
        ("tcp://127.0.0.1:\u0665\u0665", "tcp endpoint must be tcp://host:port"),
        ("ipc://relative/w.sock", "ipc endpoint needs an absolute path"),
        ("udp://127.0.0.1:5555", "endpoint must be ipc:///path or tcp://host:port"),
    ],
)
def test_a_bad_endpoint_is_refused_naming_it(url: str, message: str) -> None:
    from timeshare.errors import TransferError

    for side in (WeightSender, WeightReceiver):
        with pytest.raises(TransferError, match=message) as info:
            side(url, TransferConfig(**FAST))
        assert repr(url) in str(info.value)


def test_an_endpoint_without_room_for_the_session_socket_leaves_nothing(
    runtime_dir: Path,
) -> None:
    from timeshare.errors import TransferError

    path = runtime_dir / ("w" * (100 - len(str(runtime_dir)) - 1))
    assert len(str(path)) == 100  # fits the 107 bytes of a socket path; the session's does not
    fds = len(os.listdir("/proc/self/fd"))
    errors: list[BaseException] = []

    def construct() -> None:
        try:
            WeightSender(f"ipc://{path}", TransferConfig(**FAST))
        except BaseException as exc:
            errors.append(exc)

    # In a thread: were a socket left open, the context's term() would hang, not fail.
    thread = threading.Thread(target=construct, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "WeightSender() hung undoing its first bind"
    assert len(errors) == 1 and isinstance(errors[0], TransferError), errors
    assert "leaves no room for a session's socket (9 bytes more)" in str(errors[0])
    # The endpoint had been bound before the session's socket was refused: all undone.
    assert socket_files(runtime_dir) == []
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_a_receiver_cannot_connect_to_port_zero() -> None:
    from timeshare.errors import TransferError

    with pytest.raises(TransferError, match="the port is only for binding"):
        WeightReceiver("tcp://127.0.0.1:0", TransferConfig(**FAST))
