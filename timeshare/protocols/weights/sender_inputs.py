"""What `WeightSender.send` accepts, and the checks made on it before anything is sent.

Weights are a mapping of names to tensors, or (name, tensor) pairs: a list, a tuple, any
iterable or an async iterable. Wherever a tensor is accepted, so is a `LentTensor` (lent.py): one
that writes itself into the staging the sender lends it. A sized input (mapping, list, tuple) is
checked whole before the first header goes out, so bad input never starts a transfer. A stream
can only be checked as it is read: `pairs` checks that each item is a pair, and
`BucketPlanner.add` (layout.py) each tensor as it places it, so a bad stream fails mid-transfer
(ending the session, as any failure does).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import TypeAlias

import torch

from timeshare.errors import TransferError
from timeshare.protocols.weights.layout import Weight, check_tensor
from timeshare.protocols.weights.lent import LentTensor

NamedTensors: TypeAlias = (
    Mapping[str, Weight] | Iterable[tuple[str, Weight]] | AsyncIterable[tuple[str, Weight]]
)


def check_version(version: int) -> None:
    """A weight version is a non-negative int (bool, though an int, is refused)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise TransferError(f"version must be a non-negative int, got {version!r}")


def checked_up_front(weights: NamedTensors) -> NamedTensors:
    """`weights` ready to stream: a mapping as its pairs, a sized input checked whole first."""
    if isinstance(weights, Mapping):
        weights = list(weights.items())
    if isinstance(weights, list | tuple):
        _validate_all(weights)
    return weights


async def pairs(
    weights: Iterable[object] | AsyncIterable[object],
) -> AsyncIterator[tuple[str, Weight]]:
    """The (name, tensor) pairs of `weights`, sync or async, each checked to be a pair."""
    # Each item is dropped before the next is asked for: a producer that makes its tensors as
    # they are asked for (a sharded trainer's gathers) then never holds two at once.
    if isinstance(weights, AsyncIterable):
        async for item in weights:
            yield _unpack_pair(item)
            del item
    else:
        for item in weights:
            yield _unpack_pair(item)
            del item


async def peeked(
    items: AsyncIterator[tuple[str, Weight]],
) -> tuple[torch.device, AsyncIterator[tuple[str, Weight]]]:
    """Where the first weight of `items` lives (cpu for none), and all of `items` still to
    come: a first transfer stages its weights where they are (transport.py)."""
    first = await anext(items, None)
    device = torch.device("cpu")
    if first is not None and isinstance(first[1], torch.Tensor | LentTensor):
        device = first[1].device

    async def chained(held: list[tuple[str, Weight]]) -> AsyncIterator[tuple[str, Weight]]:
        if held:
            yield held.pop()  # not held here while the consumer has it
        async for item in items:
            yield item

    return device, chained([] if first is None else [first])


def _unpack_pair(item: object) -> tuple[str, Weight]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise TransferError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    return name, tensor


def _validate_all(
    items: list[tuple[str, Weight]] | tuple[tuple[str, Weight], ...],
) -> None:
    seen: set[str] = set()
    for item in items:
        name, tensor = _unpack_pair(item)
        check_tensor(name, tensor, seen)
        seen.add(name)
