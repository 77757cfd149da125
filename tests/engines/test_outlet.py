"""A trainer's weights on their way out: produced off the loop a batch a trip, each digested once,
in order, and never many held at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from timeshare.engines import outlet
from timeshare.engines.digest import WeightsDigest
from timeshare.engines.outlet import BATCH_BYTES, digested


async def drain(named: Any, digest: WeightsDigest) -> list[Any]:
    return [item async for item in digested(named, digest)]


@pytest.mark.asyncio
async def test_small_weights_share_a_trip_and_arrive_in_order_digested_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = [(f"norm.{i}", torch.full((1024,), float(i))) for i in range(300)]  # 4 KiB each
    trips = 0
    real = outlet._next_batch

    def counted(*args: Any) -> Any:
        nonlocal trips
        trips += 1
        return real(*args)

    monkeypatch.setattr(outlet, "_next_batch", counted)
    digest, expected = WeightsDigest(), WeightsDigest()
    got = await drain(iter(weights), digest)
    for name, tensor in weights:
        expected.add(name, tensor)
    assert [name for name, _ in got] == [name for name, _ in weights]
    assert digest.hexdigest() == expected.hexdigest()
    assert trips <= 3  # 1.2 MiB in batches of 1 MiB (and the end), not 301 trips


@pytest.mark.asyncio
async def test_a_producer_never_gets_more_than_a_batch_ahead_of_the_sender() -> None:
    sizes = [3 * BATCH_BYTES] + [BATCH_BYTES // 4] * 12 + [2 * BATCH_BYTES, 16]
    ahead: list[int] = []
    produced: list[int] = []
    sent = 0

    def producer() -> Iterator[tuple[str, torch.Tensor]]:
        for i, size in enumerate(sizes):
            produced.append(size)
            ahead.append(sum(produced[sent:]))  # bytes made and not yet taken by the sender
            yield f"w{i}", torch.zeros(size, dtype=torch.uint8)

    async for _ in digested(producer(), WeightsDigest()):
        sent += 1
    assert sent == len(sizes)
    assert max(ahead) <= BATCH_BYTES + max(sizes)


@pytest.mark.asyncio
async def test_an_item_that_is_no_pair_ends_its_batch_and_reaches_the_sender_as_it_is() -> None:
    odd = ("c", torch.ones(1), "extra")
    items: list[Any] = [("a", torch.ones(2)), odd, ("b", torch.ones(2))]
    got = await drain(iter(items), WeightsDigest())
    assert got[0][0] == "a" and got[1] is odd and got[2][0] == "b"
