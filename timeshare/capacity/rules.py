"""The rules a job's shape must keep, each broken one a `Problem` naming its key and numbers.

    ranks       a tensor-parallel group (trainer's, rollout's) lies within one node
    heads       attention heads split evenly over a tensor-parallel group; key/value heads
                split, or are replicated a whole number of times
    memory      no phase needs more than the device holds
    kv_cache    the rollout's KV cache holds at least its longest sequence
    sync        a SYNC's transfer, at the stated rate, ends within its deadline, and each
                bucket within the ACK deadline

(The config's own checks, run as it loads, come first: job.ranks = nodes x ranks per node, a
trainer's tensor-parallel size that divides job.ranks, micro-batches that divide a minibatch.)
"""

from __future__ import annotations

from typing import NamedTuple

from timeshare.capacity.memory import GIB, PHASES, Part
from timeshare.capacity.model_size import ModelSize
from timeshare.engines.footprint import RolloutFootprint, TrainerFootprint, heads_problem


class Problem(NamedTuple):
    rule: str  # one of the module docstring's
    key: str  # the key to change
    message: str


def ranks_rules(
    ranks_per_node: int, trainer: TrainerFootprint, rollout: RolloutFootprint
) -> list[Problem]:
    problems = []
    for side, size, key in (
        ("trainer", trainer.tensor_parallel, trainer.tp_key),
        ("rollout", rollout.tensor_parallel, rollout.tp_key),
    ):
        if ranks_per_node % size:
            problems.append(
                Problem(
                    "ranks",
                    key,
                    f"{key} ({size}) does not divide the ranks of a node ({ranks_per_node}): "
                    f"a {side} tensor-parallel group must lie within one node",
                )
            )
    return problems


def heads_rules(
    model: ModelSize, trainer: TrainerFootprint, rollout: RolloutFootprint
) -> list[Problem]:
    problems = []
    for size, key in (
        (trainer.tensor_parallel, trainer.tp_key),
        (rollout.tensor_parallel, rollout.tp_key),
    ):
        problem = heads_problem(size, model.heads, model.kv_heads, key)
        if problem is not None:
            problems.append(Problem("heads", key, problem))
    return problems


def memory_rules(parts: list[Part], totals: dict[str, float], device_bytes: float) -> list[Problem]:
    if device_bytes <= 0:
        return [
            Problem(
                "memory",
                "cluster.device_gib",
                "cluster.device_gib is not stated: give --device-gib (a rank's accelerator "
                "memory, GiB) or set it in [cluster]",
            )
        ]
    problems = []
    for phase in PHASES:
        if totals[phase] <= device_bytes:
            continue
        largest = sorted((p for p in parts if phase in p.phases), key=lambda p: -p.bytes)[:3]
        listed = ", ".join(f"{p.name} {p.bytes / GIB:.1f}" for p in largest)
        problems.append(
            Problem(
                "memory",
                "cluster.device_gib",
                f"{phase.upper()} needs {totals[phase] / GIB:.1f} GiB on each rank, more than "
                f"cluster.device_gib ({device_bytes / GIB:g} GiB); largest: {listed} GiB",
            )
        )
    return problems


def kv_cache_rules(tokens: int, longest: int, rollout: RolloutFootprint) -> list[Problem]:
    if tokens >= longest:
        return []
    return [
        Problem(
            "kv_cache",
            rollout.kv_key,
            f"the KV cache ({rollout.kv_key}) holds {tokens} tokens on each rank, fewer than "
            f"the longest sequence the rollout serves ({longest} tokens)",
        )
    ]


class SyncFigures(NamedTuple):
    bytes: float  # one rank's SYNC: the whole model, in the dtype the rollout receives
    seconds: float
    deadline_s: float
    deadline_key: str
    bucket_seconds: float
    ack_timeout_s: float


def sync_rules(sync: SyncFigures, gbps: float) -> list[Problem]:
    problems = []
    if sync.seconds >= sync.deadline_s:
        problems.append(
            Problem(
                "sync",
                sync.deadline_key,
                f"a SYNC moves {sync.bytes / GIB:.1f} GiB per rank: {sync.seconds:.1f} s at "
                f"cluster.sync_gbps ({gbps:g} GB/s), not within {sync.deadline_key} "
                f"({sync.deadline_s:g} s)",
            )
        )
    if sync.bucket_seconds >= sync.ack_timeout_s:
        problems.append(
            Problem(
                "sync",
                "transfer.ack_timeout_s",
                f"one bucket takes {sync.bucket_seconds:.1f} s at cluster.sync_gbps "
                f"({gbps:g} GB/s), not within transfer.ack_timeout_s ({sync.ack_timeout_s:g} s)",
            )
        )
    return problems
