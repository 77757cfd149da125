"""Moving tensors' storage off the device and back, bit for bit, under the tensors that use it
(every trainer's OFFLOAD: FSDP's and Megatron's).

FSDP2 keeps each parameter's shard, each gradient and each optimiser state in storage that
several tensors view (the parameter, its DTensor's local tensor, FSDP's padded shard). Replacing
tensors would leave FSDP holding the old ones; resizing the storage itself frees the memory under
every view at once, and resizing it back and copying the bytes in restores them all. FSDP2 frees
its gathered parameters the same way. On CUDA the bytes wait in pinned host memory and the
caching allocator's blocks are returned (`empty_cache`), so the device memory is really free; on
CPU the storage is host memory either way, and the move is as real: the original is freed and a
copy kept.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor


def return_free_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc's `malloc_trim`), wherever they lie: for
    an engine whose device is the host heap (the CPU reference trainer), once its device is
    empty each step, as a device allocator would hand back what was freed. Its parameters, AdamW
    state and activations are freed and allocated every step, and the heap fragments around
    what lives on: its free holes stayed resident, and the trainer's RSS grew 15-50 MiB per
    1,000 steps (`make soak`). (Mapping every large block instead, a fixed mmap threshold, held
    the RSS but cost each step an munmap per activation: the trainer's CPU per step 1.9x.)
    A CPU accommodation, for this process only; False where the C library is not glibc."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return False
    malloc_trim(0)  # (its answer, whether anything went back, is no failure either way)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, looked up once per process (it is called every step)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `tensor`'s bytes on this rank (a DTensor's local shard)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` (each once, however many tensors view it)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        seen.setdefault(storage._cdata, storage)
    return list(seen.values())


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the storages under `tensors` hold now (0 for a storage moved off)."""
    return sum(s.nbytes() for s in storages(tensors))


@dataclass
class HostStore:
    """Storages moved off the device, with their bytes, until they are brought back."""

    moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self.moved)

    def move_off(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages under `tensors` to the host and free them; the bytes moved."""
        moved = 0
        on_cuda = False
        for storage in storages(tensors):
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue  # already off (or empty): nothing to keep
            on_cuda |= storage.device.type == "cuda"
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
            host.copy_(_bytes_of(storage))
            self.moved.append((storage, host))
            storage.resize_(0)
            moved += nbytes
        if on_cuda:
            torch.cuda.empty_cache()  # the allocator's blocks back to the device
        return moved

    def bring_back(self) -> int:
        """Every storage moved off, re-allocated and filled with its bytes; the bytes moved."""
        moved = 0
        for storage, host in self.moved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host)
            moved += host.numel()
        self.moved.clear()
        return moved


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
