"""Settings of a weight-channel session and the report of one transfer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from timeshare.errors import ConfigError
from timeshare.protocols.weights.frames import ALIGNMENT
from timeshare.units import MIB, gbps

# Which staging a session uses; transport.py maps each to its implementation.
Transport = Literal["auto", "shm"]

MAX_PIPELINE_DEPTH = 2  # REQ/REP keeps one header in flight; deeper needs DEALER with credits


class TransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a sender/receiver pair moves weights. Both sides of a pair should use the same one.

    bucket_mb: size of each staging buffer (MiB; fractions allowed).
    pipeline_depth: 1 (one buffer, pack and consume in turn) or 2 (pack bucket k+1 while the
        receiver consumes bucket k).
    ack_timeout_s: longest wait for any reply or for the next frame within a transfer.
    finalize_timeout_s: longest the receiver's post-load processing may take.
    handshake_timeout_s: longest wait for the peer to appear and map staging.
    begin_timeout_s: longest a receiver waits for the sender to begin a transfer (an RL step's
        training runs in between, so this is long).
    linger_s: how long a closing socket keeps trying to deliver its last reply.
    checksum: add a crc32 of each bucket and check it on the receiver.
    transport: "shm" (shared memory) or "auto" (the best one for the device: shm on CPU).
    """

    bucket_mb: float = 64.0
    pipeline_depth: int = 2
    ack_timeout_s: float = 30.0
    finalize_timeout_s: float = 60.0
    handshake_timeout_s: float = 60.0
    begin_timeout_s: float = 600.0
    linger_s: float = 1.0
    checksum: bool = False
    transport: Transport = "auto"

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.bucket_bytes < ALIGNMENT:
            raise ConfigError(f"bucket_mb={self.bucket_mb} is smaller than {ALIGNMENT} bytes")
        if not 1 <= self.pipeline_depth <= MAX_PIPELINE_DEPTH:
            raise ConfigError(
                f"pipeline_depth must be 1 or {MAX_PIPELINE_DEPTH}, got {self.pipeline_depth}"
            )
        for key in ("ack_timeout_s", "finalize_timeout_s", "handshake_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}")
        if self.begin_timeout_s < self.ack_timeout_s:
            raise ConfigError(
                f"begin_timeout_s ({self.begin_timeout_s}) must not be shorter than "
                f"ack_timeout_s ({self.ack_timeout_s})"
            )
        if self.linger_s < 0:
            raise ConfigError(f"linger_s must not be negative, got {self.linger_s}")

    @property
    def bucket_bytes(self) -> int:
        """The staging buffer size in bytes, rounded down to the piece alignment."""
        return int(self.bucket_mb * MIB) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class TransferReport:
    """What one transfer moved and how fast (seconds from the first bucket to FINALIZED).

    `checksummed`: buckets that carried a crc32 (the sender) or whose crc32 was checked (the
    receiver). `ack_seconds` (the sender): for each bucket, from sending its header to its ACK.
    """

    version: int
    bytes: int
    tensors: int
    buckets: int
    seconds: float
    checksummed: int = 0
    ack_seconds: tuple[float, ...] = ()

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second."""
        return gbps(self.bytes, self.seconds)
