"""Where a trainer's weights go out: its `iter_weights`, digested as they pass, off the event loop.

The weight sender runs on the worker's event loop. A trainer's weights may be gathered as they
are asked for (FSDP's all-gathers block on collectives), so each one is produced in a worker
thread, never on the loop; and each is digested as it passes, so that no tensor has to be kept
for the digest after it went into staging: a sharded trainer holds about one bucket of gathered
weights at a time, never the whole model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator

import anyio
import torch

from timeshare.engines.base import WeightsDigest

_DONE = object()


async def digested(
    named: Iterable[tuple[str, torch.Tensor]], digest: WeightsDigest
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of `named`, each produced and digested in a worker thread."""
    items = iter(named)
    while True:
        item = await anyio.to_thread.run_sync(_next_digested, items, digest)
        if item is _DONE:
            return
        assert isinstance(item, tuple)
        yield item


def _next_digested(items: Iterator[tuple[str, torch.Tensor]], digest: WeightsDigest) -> object:
    item = next(items, _DONE)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        digest.add(item[0], item[1])
    return item  # anything else is the sender's to refuse, naming it
