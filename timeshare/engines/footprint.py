"""How an engine holds the model on each rank's device: what `timeshare plan` sizes a job by.

Each engine's spec says it for itself (`trainer_footprint`, `rollout_footprint`), so that the
plan names no engine and a new engine brings its own. Bytes here are per parameter or per
element; the plan multiplies them by the model's sizes (capacity/model_size.py).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


class TrainerFootprint(NamedTuple):
    """A trainer's state on one rank. Parameters are kept in float32 by every trainer here."""

    tensor_parallel: int  # ranks one layer's tensors are split over
    tp_key: str  # the key that sets it ("" where it is fixed), for errors
    parameter_shards: int  # ranks the float32 parameters and gradients are split over
    optimizer_shards: int  # ranks AdamW's two float32 moments are split over
    compute_bytes: int  # per element of a gathered layer and of activations
    sync_bytes: int  # per parameter sent at SYNC (the dtype the rollout receives)
    gathers_layers: bool  # a whole layer is gathered to compute (FSDP), two with prefetch
    micro_batch: int  # samples per forward/backward; 0: a whole minibatch


class RolloutFootprint(NamedTuple):
    """A rollout engine's share of one rank's device while it serves."""

    tensor_parallel: int  # consecutive ranks of one node that one engine spans
    tp_key: str
    weight_bytes: int | None  # per parameter; None: the model's own dtype ("auto")
    kv_cache_bytes: float | None  # the KV cache on each of its ranks, when set as a size
    kv_cache_tokens: int | None  # ... or as tokens the whole engine holds
    memory_fraction: float | None  # ... or: the whole engine takes this much of each device
    kv_key: str  # the key that sizes the KV cache, for errors
    longest_sequence: int  # tokens of the longest sequence it must hold (its max length)
    longest_key: str = ""  # the key that sets longest_sequence, for errors


@runtime_checkable
class HasTrainerFootprint(Protocol):
    def trainer_footprint(self, ranks: int) -> TrainerFootprint: ...


@runtime_checkable
class HasRolloutFootprint(Protocol):
    def rollout_footprint(self, sequences: int) -> RolloutFootprint: ...


def heads_problem(size: int, heads: int, kv_heads: int, key: str) -> str | None:
    """Why a tensor-parallel group of `size` cannot split a model's attention (None: it can):
    its heads must split evenly, and its key/value heads split or be replicated a whole number
    of times."""
    if heads % size:
        return f"{key} ({size}) does not divide the model's attention heads ({heads})"
    if kv_heads % size and size % kv_heads:
        return (
            f"{key} ({size}) neither divides the model's key/value heads ({kv_heads}) nor is a "
            "multiple of them"
        )
    return None
