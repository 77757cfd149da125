"""CUDA IPC staging: buffers on the sender's GPU, shared with the receiver by handle.

The sender allocates its staging on its own GPU and sends, in the handshake, each buffer's CUDA
IPC handle as torch exports it (`_share_cuda_`), field by field in a msgspec Struct, never
pickled. The receiver opens the handles on the same GPU (found by UUID: two processes may
number their GPUs differently) and reads the buckets where they are. A weight on a GPU then
goes device to device twice (into staging, out of it into the engine) and never crosses to the
host, as verl's and checkpoint-engine's CUDA IPC paths do; host staging (shm.py) stays the
transport for CPU weights and receivers without CUDA.

Lifetime: torch's IPC reference counter keeps the sender's allocator from reusing a buffer
while a receiver still maps it; `close` drops this side's references (the sender then lets
torch collect what no receiver holds any more). Device memory needs no fault-in: every buffer
is ready once allocated.
"""

from __future__ import annotations

import torch

from timeshare.errors import TransferError
from timeshare.protocols.weights.descriptions import CudaIpcBuffers, CudaIpcHandle
from timeshare.protocols.weights.staging import Staging, views_alive


class CudaIpcStaging(Staging):
    """Equal uint8 buffers on one GPU: allocated here (`create`, the sender) or opened from a
    sender's handles (`attach`, the receiver)."""

    def __init__(self, buffers: list[torch.Tensor], device: torch.device, *, owner: bool) -> None:
        self.buffers = buffers
        self.buffer_bytes = buffers[0].numel() if buffers else 0
        self.device = device
        self._owner = owner

    @classmethod
    def create(cls, *, count: int, buffer_bytes: int, device: torch.device) -> CudaIpcStaging:
        """`count` buffers of `buffer_bytes` on `device` (a CUDA device), owned by this process."""
        device = cuda_device(device)
        buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, device=device) for _ in range(count)
        ]
        return cls(buffers, device, owner=True)

    @classmethod
    def attach(cls, description: CudaIpcBuffers) -> CudaIpcStaging:
        """Open the buffers a sender described, on the GPU it named."""
        index = visible_index(description.device_uuid, visible_gpu_uuids())
        device = torch.device("cuda", index)
        buffers: list[torch.Tensor] = []
        for number, handle in enumerate(description.handles):
            if handle.storage_bytes < description.buffer_bytes:
                raise TransferError(
                    f"CUDA IPC buffer {number} holds {handle.storage_bytes} bytes, less than the "
                    f"{description.buffer_bytes} described"
                )
            storage = open_handle(handle, index)
            buffers.append(over(storage, description.buffer_bytes, device))
        return cls(buffers, device, owner=False)

    def describe(self) -> CudaIpcBuffers:
        return CudaIpcBuffers(
            device_uuid=gpu_uuid(self.device),
            handles=[export_handle(buffer) for buffer in self.buffers],
            buffer_bytes=self.buffer_bytes,
        )

    def unlink_names(self) -> None:
        """Nothing to remove: a handle is no name in any file system, and the memory goes with
        the sender's allocation once no receiver maps it."""

    def view(self, index: int) -> tuple[torch.Tensor, torch.UntypedStorage]:
        storage = self.buffers[index].untyped_storage()
        return over(storage, self.buffer_bytes, self.device), storage

    def kept_views(self, storage: torch.UntypedStorage) -> int:
        return views_alive(storage) - 1  # `buffers[i]` itself holds it too

    def start_fault_in(self) -> None:
        """Device memory is in place once allocated."""

    def is_ready(self, index: int) -> bool:
        return True

    def ready(self, index: int) -> None:
        """Always ready (see `start_fault_in`)."""

    def close(self) -> None:
        """Drop this side's references; the sender's memory is freed once no receiver holds it
        (torch's IPC reference counter), collected here when that is already so."""
        self.buffers = []
        if self._owner and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch.cuda.ipc_collect is unannotated


def cuda_device(device: torch.device) -> torch.device:
    """`device` as a CUDA device with an index (the current one for a bare "cuda"); a clear
    error where CUDA is not there."""
    if not torch.cuda.is_available():
        raise TransferError(
            f'transport "cuda_ipc" needs a CUDA device, and this process has none (torch '
            f'{torch.__version__}); use transport = "shm"'
        )
    if device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, in its own numbering ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [gpu_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def visible_index(uuid: str, visible: list[str]) -> int:
    """This process's number for the GPU `uuid`; a clear error if it does not see that GPU."""
    if not visible:
        raise TransferError(
            f"the sender offered CUDA IPC staging on GPU {uuid}, but this process sees no CUDA "
            f'device: set [transfer] transport = "shm" on both sides'
        )
    if uuid not in visible:
        raise TransferError(
            f"the sender's staging is on GPU {uuid}, which this process does not see (it sees "
            f'{", ".join(visible)}; CUDA_VISIBLE_DEVICES?): set [transfer] transport = "shm" '
            f"or make that GPU visible to the receiver"
        )
    return visible.index(uuid)


def export_handle(buffer: torch.Tensor) -> CudaIpcHandle:
    """`buffer`'s allocation as CUDA IPC exports it."""
    (
        _device,
        handle,
        storage_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = buffer.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]  # torch's _share_cuda_ is unannotated
    return CudaIpcHandle(
        handle=bytes(handle),
        storage_bytes=int(storage_bytes),
        offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle else b"",
        event_sync_required=bool(event_sync_required),
    )


def open_handle(handle: CudaIpcHandle, device_index: int) -> torch.UntypedStorage:
    """The storage a sender exported, opened in this process on GPU `device_index`."""
    torch.cuda._lazy_init()  # type: ignore[no-untyped-call]  # torch.cuda's init is unannotated
    try:
        storage: torch.UntypedStorage = torch.UntypedStorage._new_shared_cuda(
            device_index,
            handle.handle,
            handle.storage_bytes,
            handle.offset_bytes,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle or None,
            handle.event_sync_required,
        )
    except RuntimeError as exc:
        raise TransferError(f"cannot open the sender's CUDA IPC handle: {exc}") from exc
    return storage


def over(storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over the first `nbytes` of `storage`."""
    tensor = torch.empty(0, dtype=torch.uint8, device=device)
    return tensor.set_(storage, 0, (nbytes,), (1,))
