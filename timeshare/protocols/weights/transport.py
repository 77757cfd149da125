"""Which staging implementation a transfer uses: chosen by the sender, named in the handshake."""

from __future__ import annotations

from timeshare.protocols.weights.config import Transport
from timeshare.protocols.weights.descriptions import StagingDescription
from timeshare.protocols.weights.shm import SharedMemoryStaging
from timeshare.protocols.weights.staging import Staging


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
