"""Which staging implementation a transfer uses: chosen by the sender, named in the handshake."""

from __future__ import annotations

from typing import Literal, TypeAlias

from timeshare.protocols.weights.shm import SharedMemoryStaging, ShmSegments
from timeshare.protocols.weights.staging import Staging

Transport = Literal["auto", "shm"]
# The union of every implementation's handshake description (one member until CUDA IPC).
StagingDescription: TypeAlias = ShmSegments


def create_staging(
    transport: Transport, *, count: int, buffer_bytes: int, tag: str, session: int
) -> Staging:
    """The sender's staging for `transport`; "auto" is shared memory until CUDA IPC exists."""
    return SharedMemoryStaging.create(
        count=count, buffer_bytes=buffer_bytes, tag=tag, session=session
    )


def attach_staging(description: StagingDescription) -> Staging:
    """The receiver's mapping of the staging a sender described."""
    return SharedMemoryStaging.attach(description)
