"""Where each tensor's bytes sit in the staging buffers, and copying them in and out.

The sender's `BucketPlanner` takes (name, tensor) pairs one at a time and emits full buckets:
tensors are placed at aligned offsets; a tensor larger than a bucket is cut into pieces that fill
whole buckets, the remainder starting the next one. A `LentTensor` (lent.py) is placed as a whole
tensor taking all its scratch bytes, and writes itself in at packing; one whose scratch does not
fit in a bucket is materialized and cut like any large tensor. The receiver's `Assembler` turns a
bucket's pieces back into tensors: views into staging for whole tensors, and an owned tensor,
filled piece by piece, for a tensor that was cut.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from timeshare.errors import ProtocolError, TransferError
from timeshare.protocols.weights.frames import ALIGNMENT, TensorPiece, Totals
from timeshare.protocols.weights.lent import LentTensor

# What the sender accepts as a weight: a tensor, or one that writes itself into staging.
Weight = torch.Tensor | LentTensor

_DTYPE_NAMES = [
    *("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"),
    *("float16", "bfloat16", "float32", "float64", "complex64", "complex128"),
    *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"),
]
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAME = {dtype: name for name, dtype in DTYPES.items()}


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass
class PlannedPiece:
    """A piece to pack: where it goes and the source bytes it comes from."""

    piece: TensorPiece
    # The whole tensor (start == 0 and nbytes == total) or its flat bytes; or a LentTensor,
    # always whole, which writes itself into its scratch_bytes at the piece's offset.
    source: torch.Tensor | LentTensor


@dataclass
class PlannedBucket:
    pieces: list[PlannedPiece] = field(default_factory=list)
    used: int = 0  # aligned bytes taken

    @property
    def extent(self) -> int:
        return payload_extent([p.piece for p in self.pieces])

    @property
    def payload(self) -> int:
        return sum(p.piece.nbytes for p in self.pieces)

    @property
    def lends(self) -> bool:
        """Whether a piece writes itself in (and may block on a collective doing so)."""
        return any(isinstance(p.source, LentTensor) for p in self.pieces)


class BucketPlanner:
    """Cuts a stream of named tensors into buckets of at most `bucket_bytes`."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._current = PlannedBucket()
        self._names: set[str] = set()
        self.tensors = 0
        self.bytes = 0

    def add(self, name: str, weight: object) -> Iterator[PlannedBucket]:
        """Place one tensor or LentTensor; yield the buckets it completes.

        A LentTensor too large for a bucket is materialized here, after the current bucket has
        been yielded: the sender packs that bucket (running the writes of the lent pieces in it)
        before it resumes this generator, so that every rank runs the collectives of its items
        in the order the items came in.
        """
        dtype_name = check_tensor(name, weight, self._names)
        assert isinstance(weight, torch.Tensor | LentTensor)
        self._names.add(name)
        self.tensors += 1
        total = weight_nbytes(weight)
        self.bytes += total
        whole = TensorPiece(name, dtype_name, tuple(weight.shape), 0, total, 0, total)
        if isinstance(weight, LentTensor):
            if self.lent_fits(weight):
                yield from self._place_whole(whole, weight, weight.scratch_bytes)
                return
            if self._current.pieces:
                yield self._take()
            weight = materialized(name, weight)
        if total <= self.bucket_bytes:
            yield from self._place_whole(whole, weight, total)
            return
        yield from self._cut(whole, weight)

    def lent_fits(self, weight: LentTensor) -> bool:
        """Whether `weight` writes itself into a bucket (else it is materialized and cut).
        False for a scratch size that is no int: `add` then refuses it, naming the weight."""
        scratch = weight.scratch_bytes
        return isinstance(scratch, int) and scratch <= self.bucket_bytes

    def finish(self) -> Iterator[PlannedBucket]:
        """Yield the last, partly filled bucket, if any."""
        if self._current.pieces:
            yield self._take()

    def _place_whole(
        self, piece: TensorPiece, source: torch.Tensor | LentTensor, reserve: int
    ) -> Iterator[PlannedBucket]:
        """Place a whole tensor taking `reserve` bytes, after the current bucket if it lacks
        the room."""
        if self._current.used + align(reserve) > self.bucket_bytes:
            yield self._take()
        self._place(piece, source, reserve)

    def _cut(self, whole: TensorPiece, tensor: torch.Tensor) -> Iterator[PlannedBucket]:
        """Cut a tensor larger than a bucket into pieces that fill whole buckets."""
        if self._current.pieces:
            yield self._take()
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        total = whole.total
        for start in range(0, total, self.bucket_bytes):
            nbytes = min(self.bucket_bytes, total - start)
            piece = TensorPiece(whole.name, whole.dtype, whole.shape, 0, nbytes, start, total)
            self._place(piece, flat, nbytes)
            if nbytes == self.bucket_bytes:
                yield self._take()

    def _place(self, piece: TensorPiece, source: torch.Tensor | LentTensor, reserve: int) -> None:
        bucket = self._current
        placed = TensorPiece(
            piece.name,
            piece.dtype,
            piece.shape,
            bucket.used,
            piece.nbytes,
            piece.start,
            piece.total,
        )
        bucket.pieces.append(PlannedPiece(placed, source))
        bucket.used += align(reserve)

    def _take(self) -> PlannedBucket:
        bucket, self._current = self._current, PlannedBucket()
        return bucket


def weight_nbytes(weight: Weight) -> int:
    """Bytes of a weight on the wire."""
    if isinstance(weight, LentTensor):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def check_tensor(name: object, tensor: object, seen: set[str]) -> str:
    """Validate one (name, tensor) pair of the input, the tensor a torch.Tensor or a LentTensor;
    return the dtype's wire name."""
    if not isinstance(name, str) or not name:
        raise TransferError(f"weight names must be non-empty strings, got {name!r}")
    if name in seen:
        raise TransferError(f"duplicate weight name {name!r}")
    if isinstance(tensor, LentTensor):
        return check_lent(name, tensor)
    if not isinstance(tensor, torch.Tensor):
        raise TransferError(
            f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor or a LentTensor"
        )
    dtype_name = _DTYPE_NAME.get(tensor.dtype)
    if dtype_name is None:
        raise TransferError(f"weight {name!r} has dtype {tensor.dtype}, which cannot be sent")
    if tensor.layout != torch.strided:
        raise TransferError(f"weight {name!r} has layout {tensor.layout}; only dense tensors")
    return dtype_name


def check_lent(name: str, lent: LentTensor) -> str:
    """Validate a LentTensor's dtype, shape and scratch before it is lent anything."""
    dtype_name = _DTYPE_NAME.get(lent.dtype) if isinstance(lent.dtype, torch.dtype) else None
    if dtype_name is None:
        raise TransferError(f"weight {name!r} has dtype {lent.dtype}, which cannot be sent")
    shape = lent.shape
    if not isinstance(shape, tuple) or not all(_is_size(dim) for dim in shape):
        raise TransferError(f"weight {name!r} has shape {shape!r}, not a tuple of sizes")
    scratch = lent.scratch_bytes
    if not _is_size(scratch) or scratch < lent.nbytes:
        raise TransferError(
            f"weight {name!r}: scratch_bytes must be an int of at least its {lent.nbytes} "
            f"bytes, got {scratch!r}"
        )
    return dtype_name


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def materialized(name: str, lent: LentTensor) -> torch.Tensor:
    """`lent.materialize()`, checked to be the tensor it announced (the wire says its dtype and
    shape before any byte of it is read)."""
    tensor = lent.materialize()
    if not isinstance(tensor, torch.Tensor):
        raise TransferError(f"weight {name!r}: materialize() gave a {type(tensor).__name__}")
    if tensor.dtype != lent.dtype or tuple(tensor.shape) != lent.shape:
        raise TransferError(
            f"weight {name!r}: materialize() gave {tensor.dtype} {tuple(tensor.shape)}, "
            f"announced {lent.dtype} {lent.shape}"
        )
    if tensor.layout != torch.strided:
        raise TransferError(f"weight {name!r}: materialize() gave a {tensor.layout} tensor")
    return tensor


def pack(bucket: PlannedBucket, staging: torch.Tensor) -> None:
    """Copy a bucket's source bytes into a staging buffer (a flat uint8 tensor), and have each
    LentTensor write itself in, piece by piece in the bucket's order (the order of the items)."""
    for planned in bucket.pieces:
        piece = planned.piece
        if isinstance(planned.source, LentTensor):
            # Called even for zero bytes: a collective must run on every rank alike.
            lend(piece, planned.source, staging)
            continue
        if piece.nbytes == 0:
            continue
        target = staging[piece.offset : piece.offset + piece.nbytes]
        if piece.start == 0 and piece.nbytes == piece.total:
            # Whole tensor: a strided copy straight from the source, no contiguous() detour.
            target.view(DTYPES[piece.dtype]).view(piece.shape).copy_(planned.source.detach())
        else:
            target.copy_(planned.source[piece.start : piece.start + piece.nbytes])


def lend(piece: TensorPiece, lent: LentTensor, staging: torch.Tensor) -> None:
    """Hand `lent` its scratch in `staging`, at the piece's offset."""
    end = piece.offset + lent.scratch_bytes
    if end > staging.numel():  # the planner never places one so; a short slice would be silent
        raise TransferError(f"weight {piece.name!r}: scratch ends at {end}, past the buffer")
    lent.write_into(staging[piece.offset : end])


def written_devices(bucket: PlannedBucket, staging: torch.Tensor) -> set[torch.device]:
    """The devices whose queued work `pack` left writing `staging`: each source tensor's, and
    the staging's own for a LentTensor (it writes there, from wherever it lives)."""
    return {
        staging.device if isinstance(p.source, LentTensor) else p.source.device
        for p in bucket.pieces
    }


class Assembler:
    """Turns received pieces back into named tensors; tracks names for the end-of-transfer check."""

    def __init__(self, expected_names: frozenset[str] | None) -> None:
        self.expected = expected_names
        self.delivered: set[str] = set()
        self.bytes = 0
        self._partial: dict[str, tuple[TensorPiece, torch.Tensor, int]] = {}

    def unpack(
        self, pieces: list[TensorPiece], staging: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors a bucket completes: views of `staging` or reassembled owned tensors."""
        out: list[tuple[str, torch.Tensor]] = []
        for piece in pieces:
            self._check_piece(piece, staging.numel())
            if piece.start == 0 and piece.nbytes == piece.total:
                raw = staging[piece.offset : piece.offset + piece.nbytes]
                out.append((piece.name, raw.view(DTYPES[piece.dtype]).view(piece.shape)))
                self._deliver(piece)
            else:
                done = self._add_part(piece, staging)
                if done is not None:
                    out.append((piece.name, done))
        return out

    def check_complete(self, totals: Totals) -> None:
        """At the end of a transfer: nothing half-built, and counts and names as announced."""
        tensors, nbytes = totals.tensors, totals.nbytes
        if self._partial:
            raise TransferError(f"transfer ended with tensors incomplete: {sorted(self._partial)}")
        if len(self.delivered) != tensors or self.bytes != nbytes:
            raise ProtocolError(
                f"sender announced {tensors} tensors / {nbytes} bytes, "
                f"received {len(self.delivered)} / {self.bytes}"
            )
        if self.expected is not None:
            missing = sorted(self.expected - self.delivered)
            if missing:
                raise TransferError(f"expected weights missing from the transfer: {missing}")

    def _check_piece(self, piece: TensorPiece, capacity: int) -> None:
        dtype = DTYPES.get(piece.dtype)
        if dtype is None:
            raise ProtocolError(f"weight {piece.name!r} has unknown dtype {piece.dtype!r}")
        numel = 1
        for dim in piece.shape:
            if dim < 0:
                raise ProtocolError(f"weight {piece.name!r} has a negative dimension {piece.shape}")
            numel *= dim
        if numel * dtype.itemsize != piece.total:
            raise ProtocolError(
                f"weight {piece.name!r}: shape {piece.shape} of {dtype} != {piece.total} bytes"
            )
        in_buffer = piece.offset >= 0 and piece.offset + piece.nbytes <= capacity
        in_tensor = piece.start >= 0 and piece.start + piece.nbytes <= piece.total
        if not (in_buffer and in_tensor and piece.offset % ALIGNMENT == 0):
            raise ProtocolError(f"weight {piece.name!r}: piece out of bounds {piece}")
        if piece.start == 0 and (piece.name in self.delivered or piece.name in self._partial):
            raise TransferError(f"duplicate weight name {piece.name!r}")
        if self.expected is not None and piece.name not in self.expected:
            raise TransferError(f"unexpected weight {piece.name!r} (not in expected_names)")

    def _add_part(self, piece: TensorPiece, staging: torch.Tensor) -> torch.Tensor | None:
        if piece.start == 0:
            whole = torch.empty(piece.shape, dtype=DTYPES[piece.dtype])
            self._partial[piece.name] = (piece, whole, 0)
        entry = self._partial.get(piece.name)
        if entry is None or entry[0].shape != piece.shape or entry[0].dtype != piece.dtype:
            raise ProtocolError(f"weight {piece.name!r}: piece without its first part")
        first, whole, filled = entry
        if piece.start != filled:
            raise ProtocolError(f"weight {piece.name!r}: piece at {piece.start}, expected {filled}")
        flat = whole.view(-1).view(torch.uint8)
        flat[piece.start : piece.start + piece.nbytes].copy_(
            staging[piece.offset : piece.offset + piece.nbytes]
        )
        filled += piece.nbytes
        if filled < piece.total:
            self._partial[piece.name] = (first, whole, filled)
            return None
        del self._partial[piece.name]
        self._deliver(piece)
        return whole

    def _deliver(self, piece: TensorPiece) -> None:
        self.delivered.add(piece.name)
        self.bytes += piece.total


def fence(devices: Iterable[torch.device]) -> None:
    """Wait until the work queued on `devices` (copies into or out of staging) has finished."""
    for device in devices:
        if device.type == "cpu":
            continue
        synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
        if synchronize is None:
            raise TransferError(
                f"cannot fence device {device}: torch.{device.type} has no synchronize"
            )
        synchronize(device)


def payload_extent(pieces: list[TensorPiece]) -> int:
    """Bytes of a staging buffer up to the end of its last piece (what a checksum covers)."""
    return max((p.offset + p.nbytes for p in pieces), default=0)


def crc32(flat: torch.Tensor) -> int:
    """crc32 of a flat uint8 CPU tensor, read in place."""
    return zlib.crc32(flat.numpy().data)
