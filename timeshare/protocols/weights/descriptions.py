"""Handshake descriptions of staging: what a receiver needs to map the buffers a sender made.

One Struct per staging implementation, and `StagingDescription`, the union an Offer frame
carries. A leaf module (msgspec only), so that the wire format (frames.py), the staging
interface (staging.py) and each implementation (shm.py) can all name these types without
importing one another.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec


class ShmSegments(msgspec.Struct, frozen=True, tag="shm"):
    """Shared-memory staging: one /dev/shm segment name per buffer, each `buffer_bytes` long."""

    names: list[str]
    buffer_bytes: int

    @property
    def count(self) -> int:
        return len(self.names)


class CudaIpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """One device buffer as CUDA IPC exports it (torch's `_share_cuda_`), field by field: no
    pickle. The reference counter is torch's, which keeps the sender's allocator from reusing
    the memory while a receiver still maps it."""

    handle: bytes  # cudaIpcMemHandle_t of the allocation the buffer lives in
    storage_bytes: int
    offset_bytes: int  # of the buffer within that allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class CudaIpcBuffers(msgspec.Struct, frozen=True, tag="cuda_ipc"):
    """Device staging shared by handle: buffers on the sender's GPU, which the receiver maps
    and reads on the device. The GPU is named by its UUID: two processes may number it
    differently (CUDA_VISIBLE_DEVICES)."""

    device_uuid: str
    handles: list[CudaIpcHandle]
    buffer_bytes: int

    @property
    def count(self) -> int:
        return len(self.handles)


# The union of every implementation's description; the Offer frame carries one (tagged).
StagingDescription: TypeAlias = ShmSegments | CudaIpcBuffers
