"""Which staging implementation a transfer uses: chosen by the sender, named in the handshake."""

from __future__ import annotations

import torch

from timeshare.protocols.weights.config import Transport
from timeshare.protocols.weights.cuda_ipc import CudaIpcStaging
from timeshare.protocols.weights.descriptions import CudaIpcBuffers, StagingDescription
from timeshare.protocols.weights.shm import SharedMemoryStaging
from timeshare.protocols.weights.staging import Staging


def uses_cuda_ipc(transport: Transport, device: torch.device) -> bool:
    """Whether a sender whose weights are on `device` stages them on its GPU: "auto" does for
    CUDA weights, so that they never cross to the host."""
    return transport == "cuda_ipc" or (transport == "auto" and device.type == "cuda")


def create_staging(
    transport: Transport,
    *,
    count: int,
    buffer_bytes: int,
    tag: str,
    session: int,
    device: torch.device,
) -> Staging:
    """The sender's staging for `transport`, its weights being on `device`."""
    if uses_cuda_ipc(transport, device):
        return CudaIpcStaging.create(count=count, buffer_bytes=buffer_bytes, device=device)
    return SharedMemoryStaging.create(
        count=count, buffer_bytes=buffer_bytes, tag=tag, session=session
    )


def attach_staging(description: StagingDescription) -> Staging:
    """The receiver's mapping of the staging a sender described."""
    if isinstance(description, CudaIpcBuffers):
        return CudaIpcStaging.attach(description)
    return SharedMemoryStaging.attach(description)
