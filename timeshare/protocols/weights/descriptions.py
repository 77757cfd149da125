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


# The union of every implementation's description (one member until CUDA IPC).
StagingDescription: TypeAlias = ShmSegments
