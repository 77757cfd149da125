"""LentTensors: weights that write themselves into the staging the sender lends them.

Planner unit tests first (what a lent tensor reserves, when it is materialized), then real
transfers to a receiver over ZMQ and /dev/shm: mixed with plain tensors, bit for bit; written in
item order off the event loop; a failing write ending the transfer cleanly; bad input refused.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import socket_files, staging_segments
from tests.protocols.weights.peer import digest
from tests.protocols.weights.peers import Peer, endpoint
from timeshare.errors import SessionClosed, TransferError
from timeshare.protocols.weights import LentTensor, TransferConfig, WeightReceiver, WeightSender
from timeshare.protocols.weights.frames import Totals
from timeshare.protocols.weights.layout import (
    Assembler,
    BucketPlanner,
    PlannedBucket,
    Weight,
    align,
    check_tensor,
    pack,
)

BUCKET = 4096
GARBAGE = 0xEE  # what a Padded tensor writes after its bytes, as a gather's padding rows
SMALL: dict[str, Any] = {"bucket_mb": 0.25, "ack_timeout_s": 20.0, "handshake_timeout_s": 30.0}

# (what, name, thread id) of every write_into / materialize, in the order they ran.
Calls = list[tuple[str, str, int]]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class Padded(LentTensor):
    """A tensor that writes its bytes, then garbage up to `scratch_bytes` (as a gather writes its
    padding rows); records each call in `calls`."""

    def __init__(
        self, name: str, tensor: torch.Tensor, pad: int, calls: Calls | None = None
    ) -> None:
        self.name = name
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.scratch_bytes = self.nbytes + pad
        self.calls: Calls = calls if calls is not None else []

    def write_into(self, dest: torch.Tensor) -> None:
        assert dest.dtype == torch.uint8 and dest.shape == (self.scratch_bytes,)
        self.calls.append(("write", self.name, threading.get_ident()))
        dest[: self.nbytes].copy_(as_bytes(self.tensor))
        dest[self.nbytes :].fill_(GARBAGE)

    def materialize(self) -> torch.Tensor:
        self.calls.append(("materialize", self.name, threading.get_ident()))
        return self.tensor.clone()


class Failing(Padded):
    """Raises where a gather would fail (a dead rank, a timed-out collective)."""

    def write_into(self, dest: torch.Tensor) -> None:
        raise RuntimeError(f"all-gather of {self.name} failed")

    def materialize(self) -> torch.Tensor:
        raise RuntimeError(f"all-gather of {self.name} failed")


def plan(weights: Iterable[tuple[str, Weight]], bucket_bytes: int = BUCKET) -> list[PlannedBucket]:
    planner = BucketPlanner(bucket_bytes)
    buckets = [b for name, w in weights for b in planner.add(name, w)]
    return buckets + list(planner.finish())


def layout(buckets: list[PlannedBucket]) -> list[list[tuple[str, int, int, int]]]:
    """(name, offset, start, nbytes) of each piece, bucket by bucket."""
    return [
        [(p.piece.name, p.piece.offset, p.piece.start, p.piece.nbytes) for p in b.pieces]
        for b in buckets
    ]


def round_trip(
    weights: list[tuple[str, Weight]], bucket_bytes: int = BUCKET
) -> dict[str, torch.Tensor]:
    """Plan, pack and unpack bucket by bucket through one staging buffer, as the channel does."""
    planner = BucketPlanner(bucket_bytes)
    buckets = [b for name, w in weights for b in planner.add(name, w)]
    buckets += list(planner.finish())
    staging = torch.zeros(bucket_bytes, dtype=torch.uint8)
    assembler = Assembler(frozenset(name for name, _ in weights))
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        assert bucket.used <= bucket_bytes
        staging.fill_(0xAB)
        pack(bucket, staging)
        for name, tensor in assembler.unpack([p.piece for p in bucket.pieces], staging):
            out[name] = tensor.clone()
    assembler.check_complete(Totals(planner.tensors, planner.bytes))
    return out


def underlying(weight: Weight) -> torch.Tensor:
    """The tensor a weight stands for (what the receiver must get)."""
    if isinstance(weight, Padded):
        return weight.tensor
    assert isinstance(weight, torch.Tensor)
    return weight


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(as_bytes(a), as_bytes(b))


# -- the planner -----------------------------------------------------------------------------


def test_a_lent_tensor_reserves_its_aligned_scratch_and_the_next_piece_follows_it() -> None:
    lent = Padded("lent", torch.arange(25, dtype=torch.float32), pad=200)  # 100 + 200 bytes
    buckets = plan([("a", torch.ones(10)), ("lent", lent), ("b", torch.ones(3))])
    assert layout(buckets) == [[("a", 0, 0, 40), ("lent", 64, 0, 100), ("b", 64 + 320, 0, 12)]]
    assert buckets[0].pieces[1].source is lent  # written in at packing, not copied from
    assert buckets[0].used == 64 + align(300) + 64
    assert buckets[0].lends
    # The piece on the wire is the tensor itself: the receiver never learns of the scratch.
    assert buckets[0].pieces[1].piece.total == 100


def test_a_lent_tensor_whose_scratch_does_not_fit_starts_the_next_bucket() -> None:
    lent = Padded("lent", torch.ones(10), pad=BUCKET - 40 - 64)  # scratch: a bucket less 64
    buckets = plan([("a", torch.ones(10)), ("b", torch.ones(10)), ("lent", lent)])
    assert layout(buckets) == [[("a", 0, 0, 40), ("b", 64, 0, 40)], [("lent", 0, 0, 40)]]
    assert not buckets[0].lends and buckets[1].lends


def test_a_lent_tensor_larger_than_a_bucket_is_materialized_and_cut() -> None:
    calls: Calls = []
    big = Padded("big", torch.arange(2500, dtype=torch.float32), pad=64, calls=calls)
    buckets = plan([("small0", torch.ones(10)), ("big", big), ("small1", torch.ones(10))])
    assert layout(buckets) == [
        [("small0", 0, 0, 40)],
        [("big", 0, 0, 4096)],
        [("big", 0, 4096, 4096)],
        [("big", 0, 8192, 1808), ("small1", align(1808), 0, 40)],
    ]
    assert [what for what, _, _ in calls] == ["materialize"]
    assert not any(b.lends for b in buckets)  # the pieces are copied from the owned tensor


def test_a_lent_tensor_whose_scratch_alone_exceeds_a_bucket_is_materialized_whole() -> None:
    calls: Calls = []
    lent = Padded("lent", torch.arange(1000, dtype=torch.float32), pad=BUCKET, calls=calls)
    buckets = plan([("a", torch.ones(10)), ("lent", lent)])
    # The bucket before it is yielded before it is materialized (a collective runs after the
    # writes of the items before it), then the tensor is placed whole.
    assert layout(buckets) == [[("a", 0, 0, 40)], [("lent", 0, 0, 4000)]]
    assert [what for what, _, _ in calls] == ["materialize"]
    out = round_trip([("lent", lent)])
    assert_identical(out["lent"], lent.tensor)


def test_lent_and_plain_tensors_round_trip_and_padding_never_leaks() -> None:
    gen = torch.Generator().manual_seed(0)
    weights: list[tuple[str, Weight]] = [
        ("plain", torch.randn(7, 3, generator=gen)),
        ("lent.f32", Padded("lent.f32", torch.randn(37, 5, generator=gen), pad=300)),
        ("lent.bf16", Padded("lent.bf16", torch.randn(9, generator=gen).bfloat16(), pad=1)),
        ("lent.t", Padded("lent.t", torch.randn(20, 30, generator=gen).t(), pad=0)),
        ("lent.empty", Padded("lent.empty", torch.empty(0, 4), pad=64)),
        ("lent.scalar", Padded("lent.scalar", torch.tensor(3, dtype=torch.int64), pad=5)),
        ("lent.big", Padded("lent.big", torch.randn(3000, generator=gen), pad=64)),
        ("after", torch.arange(5)),
    ]
    out = round_trip(weights)
    for name, weight in weights:
        assert_identical(out[name], underlying(weight))


def test_a_materialized_tensor_must_be_the_one_announced() -> None:
    class Liar(Padded):
        def materialize(self) -> torch.Tensor:
            return self.tensor.reshape(-1)[:-1].clone()

    liar = Liar("liar", torch.ones(2000), pad=0)
    with pytest.raises(
        TransferError, match=r"'liar': materialize\(\) gave torch.float32 \(1999,\)"
    ):
        plan([("liar", liar)])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        ({"dtype": torch.qint8}, "'w' has dtype torch.qint8, which cannot be sent"),
        (
            {"scratch_bytes": 39},
            "'w': scratch_bytes must be an int of at least its 40 bytes, got 39",
        ),
        ({"scratch_bytes": "big"}, "'w': scratch_bytes must be .* got 'big'"),
        ({"shape": (10, -1)}, r"'w' has shape \(10, -1\), not a tuple of sizes"),
        ({"shape": [10]}, r"'w' has shape \[10\], not a tuple of sizes"),
    ],
)
def test_the_planner_refuses_a_bad_lent_tensor_naming_it(
    mutate: dict[str, Any], message: str
) -> None:
    lent = Padded("w", torch.ones(10), pad=0)
    for attribute, value in mutate.items():
        setattr(lent, attribute, value)
    with pytest.raises(TransferError, match=message):
        check_tensor("w", lent, set())
    with pytest.raises(TransferError, match=message):
        plan([("w", lent)])


# -- real transfers ------------------------------------------------------------------------


def mixed_weights(calls: Calls | None = None) -> list[tuple[str, Weight]]:
    """Plain and lent tensors for 0.25 MiB buckets: padding followed by another piece in the
    same bucket, a lent tensor larger than a bucket, one whose scratch alone is, and more."""
    gen = torch.Generator().manual_seed(1)

    def lent(name: str, tensor: torch.Tensor, pad: int) -> tuple[str, Weight]:
        return name, Padded(name, tensor, pad, calls)

    return [
        ("plain.a", torch.randn(1000, generator=gen)),
        lent("lent.a", torch.randn(37, 29, generator=gen), 1000),
        lent("lent.b", torch.randn(100, generator=gen).bfloat16(), 7),  # inside a's bucket
        ("plain.t", torch.randn(64, 48, generator=gen).t()),
        lent("lent.empty", torch.empty(0, 5), 64),
        lent("lent.big", torch.randn(100_000, generator=gen), 100),  # 400 KB: cut
        lent("lent.scratch_big", torch.randn(60_000, generator=gen), 30_000),  # 270 KB scratch
        ("plain.after", torch.randn(10, generator=gen)),
        lent("lent.int", torch.arange(17, dtype=torch.int64), 3),
        lent("lent.last", torch.randn(3, 3, generator=gen).half(), 200),
    ]


def as_input(weights: list[tuple[str, Weight]], kind: str) -> Any:
    if kind == "mapping":
        return dict(weights)

    async def stream() -> AsyncIterator[tuple[str, Weight]]:
        for item in weights:
            yield item

    return stream() if kind == "async" else weights


def test_the_mixed_set_has_the_layouts_it_says() -> None:
    weights = mixed_weights()
    buckets = plan(weights, TransferConfig(**SMALL).bucket_bytes)
    placed = [[p.piece.name for p in b.pieces] for b in buckets]
    shared = next(b for b in buckets if "lent.a" in [p.piece.name for p in b.pieces])
    pieces = {p.piece.name: p for p in shared.pieces}
    a, b = pieces["lent.a"], pieces["lent.b"]
    assert isinstance(a.source, LentTensor)
    # b follows a's padding in the same bucket: a's garbage lies between two pieces.
    assert b.piece.offset == a.piece.offset + align(a.source.scratch_bytes)
    assert a.source.scratch_bytes - a.source.nbytes == 1000
    assert sum(names.count("lent.big") for names in placed) == 2  # cut in two


@pytest.mark.asyncio
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("kind", ["list", "mapping", "async"])
async def test_lent_and_plain_tensors_arrive_bit_identical(
    runtime_dir: Path, depth: int, kind: str
) -> None:
    cfg: dict[str, Any] = {**SMALL, "pipeline_depth": depth, "checksum": True}
    weights = mixed_weights()
    expected = {name: digest(underlying(w)) for name, w in weights}
    nbytes = sum(underlying(w).numel() * underlying(w).element_size() for _, w in weights)
    with Peer(role="receiver", endpoint=endpoint(runtime_dir), config=cfg, transfers=2) as peer:
        peer.wait_ready()
        with WeightSender(endpoint(runtime_dir), TransferConfig(**cfg)) as sender:
            for version in (0, 1):  # the second on warm staging, the last one's padding in it
                report = await sender.send(as_input(weights, kind), version=version)
                assert (report.tensors, report.bytes) == (len(weights), nbytes)
                assert report.checksummed == report.buckets
                event = peer.next_event()
                assert event["event"] == "received", event
                assert event["digests"] == expected
                assert event["checksummed"] == report.buckets
        assert peer.wait() == 0
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_writes_run_in_item_order_and_never_on_the_event_loop(runtime_dir: Path) -> None:
    calls: Calls = []
    weights = mixed_weights(calls)
    lent_names = [name for name, w in weights if isinstance(w, LentTensor)]
    cfg = TransferConfig(**SMALL)
    got: dict[str, torch.Tensor] = {}

    def receive() -> None:
        with WeightReceiver(endpoint(runtime_dir), cfg) as receiver:
            for _ in range(2):
                receiver.receive(lambda items: got.update((n, t.clone()) for n, t in items))

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        with WeightSender(endpoint(runtime_dir), cfg) as sender:
            for version in (0, 1):
                calls.clear()
                await sender.send(weights, version=version)
                # Every bucket is under the inline-packing size: lent ones are threaded anyway.
                assert [name for _, name, _ in calls] == lent_names
                assert threading.get_ident() not in {ident for _, _, ident in calls}
                assert {what for what, _, _ in calls} == {"write", "materialize"}
    finally:
        thread.join(timeout=30)
    assert not thread.is_alive()
    for name, weight in weights:
        assert_identical(got[name], underlying(weight))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "position", ["first", "mid-transfer", "materialized"], ids=lambda p: f"fails-{p}"
)
async def test_a_failing_write_ends_the_transfer_with_its_error(
    runtime_dir: Path, position: str
) -> None:
    gen = torch.Generator().manual_seed(2)
    failing = Failing("boom", torch.randn(300_000 if position == "materialized" else 100), pad=8)
    before: list[tuple[str, Weight]] = [
        ("lent.ok", Padded("lent.ok", torch.randn(50, generator=gen), pad=8)),
        ("plain.big", torch.randn(200_000, generator=gen)),  # more than a bucket: sent first
    ]
    weights = [*(before if position != "first" else []), ("boom", failing), ("x", torch.ones(2))]
    with Peer(role="receiver", endpoint=endpoint(runtime_dir), config=SMALL) as peer:
        peer.wait_ready()
        with WeightSender(endpoint(runtime_dir), TransferConfig(**SMALL)) as sender:
            with pytest.raises(RuntimeError, match="all-gather of boom failed"):
                await sender.send(weights, version=3)
            event = peer.next_event()
            assert (event["event"], event["type"]) == ("error", "TransferError"), event
            assert "sender aborted the transfer of version 3" in event["message"]
            assert "all-gather of boom failed" in event["message"]
            assert sender.staging_buffers == 0
            with pytest.raises(SessionClosed, match="new sender/receiver pair"):
                await sender.send({"x": torch.ones(1)}, version=4)
        assert peer.wait() == 0
    assert staging_segments(runtime_dir) == set()
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["list", "mapping"])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"dtype": torch.qint8}, "weight 'lent' has dtype torch.qint8, which cannot be sent"),
        ({"scratch_bytes": 10}, "weight 'lent': scratch_bytes must be an int of at least its 40"),
    ],
    ids=["dtype", "scratch"],
)
async def test_bad_lent_input_is_refused_before_anything_is_sent(
    runtime_dir: Path, kind: str, bad: dict[str, Any], message: str
) -> None:
    lent = Padded("lent", torch.ones(10), pad=0)
    for attribute, value in bad.items():
        setattr(lent, attribute, value)
    weights: list[tuple[str, Weight]] = [("ok", Padded("ok", torch.ones(2), pad=0)), ("lent", lent)]
    # No receiver exists: had the sender tried to send, it would wait for the handshake.
    with WeightSender(endpoint(runtime_dir), TransferConfig(**SMALL)) as sender:
        with pytest.raises(TransferError, match=message) as info:
            await sender.send(as_input(weights, kind), version=0)
        assert not isinstance(info.value, SessionClosed)
        assert sender.staging_buffers == 0
    assert socket_files(runtime_dir) == []
