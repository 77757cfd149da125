"""Settings of a weight-channel session and the report of one transfer."""

from __future__ import annotations

import math
import numbers
from typing import Literal, get_args

import msgspec

from timeshare.errors import ConfigError
from timeshare.protocols.weights.frames import ALIGNMENT
from timeshare.timing import Span
from timeshare.units import MAX_DEADLINE_S, MIB, gbps

# Which staging a session uses; transport.py maps each to its implementation.
Transport = Literal["auto", "shm", "cuda_ipc"]

MAX_PIPELINE_DEPTH = 2  # REQ/REP keeps one header in flight; deeper needs DEALER with credits
# Every buffer of the pipeline is resident host memory (shared memory on CPU); a bucket larger
# than this is a typo for a smaller one, not a plan.
MAX_BUCKET_MB = 64 * 1024
# close() blocks up to linger_s while the last reply goes out; a minute is already generous.
MAX_LINGER_S = 60.0
# A deadline shorter than a millisecond expires before any peer could answer.
MIN_DEADLINE_S = 0.001
DEADLINES = ("ack_timeout_s", "finalize_timeout_s", "handshake_timeout_s", "begin_timeout_s")


class TransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a sender/receiver pair moves weights. Both sides of a pair should use the same one.

    bucket_mb: size of each staging buffer (MiB; fractions allowed).
    pipeline_depth: 1 (one buffer, pack and consume in turn) or 2 (pack bucket k+1 while the
        receiver consumes bucket k).
    ack_timeout_s: longest wait for any reply or for the next frame within a transfer.
    finalize_timeout_s: longest the receiver's post-load processing may take.
    handshake_timeout_s: longest wait for each step of the handshake: a receiver to take the
        invitation, to answer it, to connect to the session's socket, to map staging.
    begin_timeout_s: longest a receiver waits for the sender to begin a transfer (an RL step's
        training runs in between, so this is long).
    linger_s: how long closing may take to deliver the last message: the receiver's last
        reply (zmq linger), the sender's goodbye (waiting for the receiver to answer it).
    checksum: add a crc32 of each bucket and check it on the receiver.
    transport: "shm" (host shared memory), "cuda_ipc" (buffers on the sender's GPU, shared by
        handle: weights on a GPU never cross to the host) or "auto" (cuda_ipc when the first
        weight of the first transfer is on a CUDA device, shm otherwise).

    Any value that cannot work is a ConfigError naming its key, raised here, at construction:
    not later inside a transfer (whatever built the config, a TOML file or a caller's code).
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
        check_number("bucket_mb", self.bucket_mb, above=0, most=MAX_BUCKET_MB)
        if self.bucket_bytes < ALIGNMENT:
            raise ConfigError(f"bucket_mb={self.bucket_mb} is smaller than {ALIGNMENT} bytes")
        _check_int("pipeline_depth", self.pipeline_depth)
        if not 1 <= self.pipeline_depth <= MAX_PIPELINE_DEPTH:
            raise ConfigError(
                f"pipeline_depth must be 1 or {MAX_PIPELINE_DEPTH}, got {self.pipeline_depth}"
            )
        for key in DEADLINES:
            check_number(key, getattr(self, key), least=MIN_DEADLINE_S, most=MAX_DEADLINE_S)
        if self.begin_timeout_s < self.ack_timeout_s:
            raise ConfigError(
                f"begin_timeout_s ({self.begin_timeout_s:g} s) must not be shorter than "
                f"ack_timeout_s ({self.ack_timeout_s:g} s)"
            )
        check_number("linger_s", self.linger_s, least=0, most=MAX_LINGER_S)
        if not isinstance(self.checksum, bool):
            raise ConfigError(f"checksum must be true or false, got {self.checksum!r}")
        if self.transport not in get_args(Transport):
            choices = ", ".join(repr(t) for t in get_args(Transport))
            raise ConfigError(f"transport must be one of {choices}, got {self.transport!r}")

    @property
    def bucket_bytes(self) -> int:
        """The staging buffer size in bytes, rounded down to the piece alignment."""
        return int(self.bucket_mb * MIB) // ALIGNMENT * ALIGNMENT


def _check_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{key} must be an int, got {value!r}")


def check_number(
    key: str,
    value: object,
    *,
    above: float | None = None,
    least: float | None = None,
    most: float,
) -> None:
    """`value` is a finite real number (numpy's too), > `above` (or >= `least`), <= `most`;
    else a ConfigError (a ValueError) naming `key` (a setting, or an argument of a call)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if above is not None and not value > above:
        bound = "positive" if above == 0 else f"more than {above:g}"
        raise ConfigError(f"{key} must be {bound}, got {value}")
    if least is not None and not value >= least:
        raise ConfigError(f"{key} must be at least {least:g}, got {value}")
    if value > most:
        raise ConfigError(f"{key} must be at most {most:g}, got {value}")


class TransferReport(msgspec.Struct, frozen=True):
    """What one transfer moved and how fast (seconds from the first bucket to FINALIZED).

    `checksummed`: buckets that carried a crc32 (the sender) or whose crc32 was checked (the
    receiver). `ack_seconds` (the sender): for each bucket, from sending its header to its ACK.
    `spans`: where the transfer's time went, one after another (timing.py): the sender's
    `pack N`, `ACK N`, `release`, `finalize`; the receiver's `load N`, `finalize`.
    """

    version: int
    bytes: int
    tensors: int
    buckets: int
    seconds: float
    checksummed: int = 0
    ack_seconds: tuple[float, ...] = ()
    spans: tuple[Span, ...] = ()

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second."""
        return gbps(self.bytes, self.seconds)
