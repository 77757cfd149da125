"""Where a trainer's weights go out: its `iter_weights`, digested as they pass, off the event loop.

The weight sender runs on the worker's event loop. A trainer's weights may be gathered as they
are asked for (FSDP's all-gathers block on collectives), so they are produced in a worker
thread, never on the loop, a small batch a trip; and each is digested as it passes, so that no
tensor has to be kept for the digest after it went into staging: a sharded trainer holds about
one bucket of gathered weights at a time, never the whole model. A `LentTensor` (a gather
straight into staging) is digested from the staging bytes it wrote, which are exactly what the
receiver gets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator

import anyio
import torch

from timeshare.engines.digest import WeightsDigest
from timeshare.protocols.weights.layout import Weight
from timeshare.protocols.weights.lent import LentTensor

_DONE = object()
# Weights produced in one trip to a worker thread: a trip costs 0.1-0.2 ms here, and a model's
# hundreds of norms and biases each took one. Small: a trainer that gathers as it is asked holds
# at most this much more than the weight the sender packs.
BATCH_BYTES = 1 << 20


class DigestedLent(LentTensor):
    """A `LentTensor` that adds what it wrote (or materialized) to a digest."""

    def __init__(self, name: str, inner: LentTensor, digest: WeightsDigest) -> None:
        self.name = name
        self.inner = inner
        self.digest = digest
        self.dtype = inner.dtype
        self.shape = inner.shape
        self.scratch_bytes = inner.scratch_bytes

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def write_into(self, dest: torch.Tensor) -> None:
        self.inner.write_into(dest)
        self.digest.add(self.name, dest[: self.nbytes].view(self.dtype).view(self.shape))

    def materialize(self) -> torch.Tensor:
        tensor = self.inner.materialize()
        self.digest.add(self.name, tensor)
        return tensor


async def digested(
    named: Iterable[tuple[str, Weight]], digest: WeightsDigest
) -> AsyncIterator[tuple[str, Weight]]:
    """Every (name, weight) of `named`, produced (and a tensor digested) in a worker thread, a
    batch of them at a time (`BATCH_BYTES`); a LentTensor is digested when the sender has it
    write."""
    items = iter(named)
    while True:
        batch = await anyio.to_thread.run_sync(_next_batch, items, digest)
        while batch:
            item = batch.popleft()
            if item is _DONE:
                return
            assert isinstance(item, tuple)
            yield item
            del item  # not held while the next one is gathered


def _next_batch(items: Iterator[tuple[str, Weight]], digest: WeightsDigest) -> deque[object]:
    """The next weights, each digested, until they come to BATCH_BYTES (at least one), or the
    end, or an item the sender is to refuse."""
    batch: deque[object] = deque()
    nbytes = 0
    while nbytes < BATCH_BYTES:
        item = _next_digested(items, digest)
        batch.append(item)
        if not isinstance(item, tuple) or len(item) != 2:
            break
        weight = item[1]
        nbytes += weight.nbytes if isinstance(weight, torch.Tensor | LentTensor) else BATCH_BYTES
    return batch


def _next_digested(items: Iterator[tuple[str, Weight]], digest: WeightsDigest) -> object:
    item = next(items, _DONE)
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
        return item  # the sender's to refuse, naming it
    name, weight = item
    if isinstance(weight, LentTensor):
        return name, DigestedLent(name, weight, digest)
    if isinstance(weight, torch.Tensor):
        digest.add(name, weight)
    return item


def drain(
    named: Iterable[tuple[str, Weight]], digest: WeightsDigest, bucket_bytes: int
) -> tuple[int, int]:
    """What a trainer rank that sends nothing at SYNC does with its weights (its rollout is
    served by another rank's engine: a tensor-parallel group): produce every one in order,
    running the collectives the sending rank runs as it packs (a `LentTensor` writes itself
    into scratch of the size it would have in staging, or is materialized where the sender
    would materialize it), and digest it. Returns (tensors, bytes) produced."""
    tensors = nbytes = 0
    scratch: torch.Tensor | None = None
    for name, weight in named:
        if isinstance(weight, LentTensor):
            if isinstance(weight.scratch_bytes, int) and weight.scratch_bytes <= bucket_bytes:
                if scratch is None or scratch.numel() < weight.scratch_bytes:
                    scratch = torch.empty(bucket_bytes, dtype=torch.uint8, device=weight.device)
                lent = scratch[: weight.scratch_bytes]
                weight.write_into(lent)
                digest.add(name, lent[: weight.nbytes].view(weight.dtype).view(weight.shape))
            else:
                digest.add(name, weight.materialize())
            nbytes += weight.nbytes
        else:
            digest.add(name, weight)
            nbytes += weight.nbytes
        tensors += 1
    return tensors, nbytes
