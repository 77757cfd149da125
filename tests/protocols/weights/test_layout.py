"""Bucket planning, packing and reassembly without sockets: every layout round-trips exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from timeshare.errors import ProtocolError, TransferError
from timeshare.protocols.weights.frames import TensorPiece, Totals
from timeshare.protocols.weights.layout import DTYPES, Assembler, BucketPlanner, align, pack

BUCKET = 4096


def round_trip(
    weights: list[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET
) -> tuple[dict[str, torch.Tensor], int]:
    """Plan, pack into one staging buffer and unpack bucket by bucket, as the channel does."""
    planner = BucketPlanner(bucket_bytes)
    buckets = [b for name, t in weights for b in planner.add(name, t)]
    buckets += list(planner.finish())
    staging = torch.zeros(bucket_bytes, dtype=torch.uint8)
    assembler = Assembler(frozenset(name for name, _ in weights))
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        assert bucket.pieces and bucket.used <= bucket_bytes
        staging.fill_(0xAB)  # stale bytes must never leak into a tensor
        pack(bucket, staging)
        for name, tensor in assembler.unpack([p.piece for p in bucket.pieces], staging):
            out[name] = tensor.clone()
    assembler.check_complete(Totals(planner.tensors, planner.bytes))
    return out, len(buckets)


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(as_bytes(a), as_bytes(b))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_every_dtype_round_trips(dtype: torch.dtype) -> None:
    # Arbitrary bit patterns, NaNs included (bool only has two valid ones).
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (3 * BUCKET,), dtype=torch.uint8)
    usable = raw[: (raw.numel() // dtype.itemsize) * dtype.itemsize]
    whole = usable.view(dtype)
    weights = [
        ("small", whole[:10]),
        ("big", whole),
        ("nc", whole[: 60 // dtype.itemsize * 2][::2]),
    ]
    out, _ = round_trip(weights)
    for name, tensor in weights:
        assert_identical(out[name], tensor)


def test_zero_element_and_zero_dim_tensors() -> None:
    weights = [
        ("empty", torch.empty(0, 5)),
        ("scalar", torch.tensor(1.5)),
        ("empty.int", torch.empty(0, dtype=torch.int64)),
        ("after", torch.arange(7)),
    ]
    out, buckets = round_trip(weights)
    assert buckets == 1
    for name, tensor in weights:
        assert_identical(out[name], tensor)


def test_large_tensor_fills_whole_buckets_and_the_rest_is_shared() -> None:
    big = torch.arange(2500, dtype=torch.float32)  # 10000 bytes: 4096 + 4096 + 1808
    planner = BucketPlanner(BUCKET)
    buckets = list(planner.add("small0", torch.ones(10))) + list(planner.add("big", big))
    buckets += list(planner.add("small1", torch.ones(10))) + list(planner.finish())
    layout = [[(p.piece.name, p.piece.start, p.piece.nbytes) for p in b.pieces] for b in buckets]
    assert layout == [
        [("small0", 0, 40)],
        [("big", 0, 4096)],
        [("big", 4096, 4096)],
        [("big", 8192, 1808), ("small1", 0, 40)],
    ]
    assert buckets[3].pieces[1].piece.offset == align(1808)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=1, max_size=8),
    dtypes=st.lists(st.sampled_from(list(DTYPES.values())), min_size=8, max_size=8),
    bucket_kb=st.integers(1, 8),
    transpose=st.booleans(),
)
def test_random_layouts_round_trip(
    shapes: list[list[int]], dtypes: list[torch.dtype], bucket_kb: int, transpose: bool
) -> None:
    weights = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=False)):
        high = 2 if dtype == torch.bool else 256
        numel = torch.Size(shape).numel()
        raw = torch.randint(0, high, (max(1, numel) * dtype.itemsize,), dtype=torch.uint8)
        tensor = raw.view(dtype)[:numel].view(shape)
        if transpose and tensor.dim() >= 2:
            tensor = tensor.transpose(0, 1)
        weights.append((f"w{i}", tensor))
    out, _ = round_trip(weights, bucket_kb * 1024)
    for name, tensor in weights:
        assert_identical(out[name], tensor)


def test_assembler_refuses_pieces_outside_the_buffer_or_the_tensor() -> None:
    staging = torch.zeros(BUCKET, dtype=torch.uint8)
    bad = [
        TensorPiece("a", "float32", (4,), BUCKET - 8, 16, 0, 16),  # past the buffer's end
        TensorPiece("a", "float32", (4,), 0, 16, 0, 20),  # total disagrees with shape
        TensorPiece("a", "float32", (4,), 3, 16, 0, 16),  # misaligned
        TensorPiece("a", "float32", (-4,), 0, 16, 0, 16),  # negative dimension
        TensorPiece("a", "complex32x", (4,), 0, 16, 0, 16),  # unknown dtype
        TensorPiece("a", "float32", (4,), 0, 8, 8, 16),  # continuation with no first part
    ]
    for piece in bad:
        with pytest.raises(ProtocolError, match="'a'"):
            Assembler(None).unpack([piece], staging)


def test_assembler_names_duplicates_extras_and_missing() -> None:
    staging = torch.zeros(BUCKET, dtype=torch.uint8)
    piece = TensorPiece("a", "float32", (4,), 0, 16, 0, 16)
    assembler = Assembler(frozenset({"a", "b"}))
    assembler.unpack([piece], staging)
    with pytest.raises(TransferError, match="duplicate weight name 'a'"):
        assembler.unpack([piece], staging)
    with pytest.raises(TransferError, match="unexpected weight 'c'"):
        assembler.unpack([TensorPiece("c", "float32", (4,), 64, 16, 0, 16)], staging)
    with pytest.raises(TransferError, match=r"missing from the transfer: \['b'\]"):
        assembler.check_complete(Totals(1, 16))


def test_planner_refuses_bad_values() -> None:
    planner = BucketPlanner(BUCKET)
    list(planner.add("a", torch.ones(1)))
    with pytest.raises(TransferError, match="duplicate weight name 'a'"):
        list(planner.add("a", torch.ones(1)))
    with pytest.raises(TransferError, match=r"is a int, not a torch\.Tensor"):
        list(planner.add("b", 3))
    with pytest.raises(TransferError, match="non-empty strings"):
        list(planner.add(7, torch.ones(1)))  # type: ignore[arg-type]
