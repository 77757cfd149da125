"""CUDA IPC staging: the wire format, the choice of transport, and every refusal, on any machine;
the transfer itself between two processes on a GPU (marked `gpu`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.conftest import socket_files, staging_segments
from tests.protocols.weights.peer import digest, make_weights
from tests.protocols.weights.peers import Peer, endpoint
from timeshare.errors import PeerError, TransferError
from timeshare.protocols.weights import TransferConfig, WeightSender, frames
from timeshare.protocols.weights import sender as sender_module
from timeshare.protocols.weights.cuda_ipc import visible_index
from timeshare.protocols.weights.descriptions import CudaIpcBuffers, CudaIpcHandle, ShmSegments
from timeshare.protocols.weights.shm import SharedMemoryStaging
from timeshare.protocols.weights.transport import attach_staging, uses_cuda_ipc

FAST: dict[str, Any] = {"bucket_mb": 0.25, "ack_timeout_s": 20.0, "handshake_timeout_s": 20.0}
HANDLE = CudaIpcHandle(
    handle=b"\x01" * 64,
    storage_bytes=1 << 20,
    offset_bytes=512,
    ref_counter_handle=b"/torch_123_456",
    ref_counter_offset=3,
    event_handle=b"",
    event_sync_required=False,
)
OFFERED = CudaIpcBuffers(
    device_uuid="GPU-0000-test", handles=[HANDLE, HANDLE], buffer_bytes=1 << 20
)


def test_an_offer_of_device_staging_crosses_the_wire_whole_and_shm_still_does() -> None:
    for staging in (OFFERED, ShmSegments(names=["a", "b"], buffer_bytes=4096)):
        offer = frames.Offer(1, 7, staging)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(offer), type=frames.Offer)
        assert decoded == offer and decoded.staging.count == 2


@pytest.mark.parametrize(
    ("transport", "device", "on_gpu"),
    [
        ("auto", "cpu", False),
        ("auto", "cuda", True),
        ("auto", "meta", False),
        ("shm", "cuda", False),
        ("cuda_ipc", "cpu", True),
    ],
)
def test_auto_stages_on_the_gpu_exactly_when_the_weights_are_there(
    transport: Any, device: str, on_gpu: bool
) -> None:
    assert uses_cuda_ipc(transport, torch.device(device)) is on_gpu


def test_a_receiver_finds_the_senders_gpu_by_uuid_or_says_why_not() -> None:
    assert visible_index("GPU-b", ["GPU-a", "GPU-b"]) == 1  # another process's number for it
    with pytest.raises(TransferError, match=r"GPU-c, which this process does not see.*VISIBLE"):
        visible_index("GPU-c", ["GPU-a", "GPU-b"])
    with pytest.raises(
        TransferError, match=r'sees no CUDA device: set \[transfer\] transport = "shm"'
    ):
        visible_index("GPU-a", [])


def test_a_buffer_smaller_than_described_is_refused() -> None:
    short = msgspec.structs.replace(OFFERED, buffer_bytes=2 << 20)
    visible = torch.cuda.is_available()
    match = "holds 1048576 bytes, less than the 2097152" if visible else "sees no CUDA device"
    with pytest.raises(TransferError, match=match):
        attach_staging(short)


@pytest.mark.asyncio
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
async def test_cuda_ipc_asked_for_without_cuda_is_refused_at_once_naming_the_way_out(
    runtime_dir: Path,
) -> None:
    sender = WeightSender(endpoint(runtime_dir), TransferConfig(**FAST, transport="cuda_ipc"))
    with pytest.raises(TransferError, match=r'"cuda_ipc" needs a CUDA device.*transport = "shm"'):
        await sender.send({"w": torch.ones(4)}, version=1)
    sender.close()
    assert socket_files(runtime_dir) == [] and staging_segments(runtime_dir) == set()


class _OffersDeviceStaging(SharedMemoryStaging):
    """Shared memory that describes itself as a GPU's: what a GPU sender offers a receiver."""

    def describe(self) -> Any:
        return OFFERED


@pytest.mark.asyncio
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a receiver without CUDA")
async def test_a_receiver_without_cuda_refuses_device_staging_by_name_and_the_sender_hears_why(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def create(*args: Any, **kwargs: Any) -> SharedMemoryStaging:
        kwargs.pop("device")
        kwargs.pop("transport", None)
        made = SharedMemoryStaging.create(**kwargs)
        made.__class__ = _OffersDeviceStaging
        return made

    monkeypatch.setattr(sender_module, "create_staging", create)
    with Peer(role="receiver", endpoint=endpoint(runtime_dir), config=FAST) as peer:
        peer.wait_ready()
        sender = WeightSender(endpoint(runtime_dir), TransferConfig(**FAST))
        with pytest.raises(PeerError, match="this process sees no CUDA device") as info:
            await sender.send(make_weights("mb:1:0.125", 0), version=1)
        assert info.value.remote_type == "TransferError"
        event = peer.next_event()
        assert event["event"] == "error" and 'transport = "shm"' in event["message"]
        sender.close()
    assert socket_files(runtime_dir) == [] and staging_segments(runtime_dir) == set()


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_weights_on_a_gpu_go_through_device_staging_bit_identical(runtime_dir: Path) -> None:
    weights = {name: t.cuda() for name, t in make_weights("all_dtypes", 3).items()}
    before = staging_segments()
    with Peer(
        role="receiver", endpoint=endpoint(runtime_dir), config=FAST, device="cuda", transfers=2
    ) as peer:
        peer.wait_ready()
        with WeightSender(endpoint(runtime_dir), TransferConfig(**FAST)) as sender:
            for version in (1, 2):
                report = await sender.send(weights, version=version)
                event = peer.next_event()
                assert event["event"] == "received" and event["version"] == version, event
                assert event["devices"] == ["cuda"]  # views of device staging, not host copies
                expected = {name: digest(t) for name, t in weights.items()}
                assert event["digests"] == expected
                assert report.buckets > 1
                assert staging_segments() == before  # nothing staged in /dev/shm
        assert peer.wait() == 0
    assert socket_files(runtime_dir) == []
