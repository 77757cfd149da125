"""Whether every rollout holds the weights its trainer sent at SYNC, and what the cycle does when
one does not: pure functions of what each rank's SYNC reported. The cycle performs the verdict
as each step's SYNC ends (cycle/weights_check.py); the step's `weights_match` figure is the same
check (cycle/steps.py).

Rules (the functions below are the truth; this comment explains them):

- A rank's rollout holds its trainer's weights when the digest of what reached its engine's
  loader is the digest of what its trainer sent (engines/digest.py: equal iff every name,
  dtype, shape and byte agrees).
- An engine whose tensor-parallel workers each load the version (the trainer's session went to
  N receivers) must report each of the N workers once, each with the trainer's digest. A worker
  that sent no report is a mismatch, not a pass: what cannot be shown to hold the weights may
  hold anything. An engine that loads in one process (N = 1) may report no workers: its own
  digest is its one worker's.
- A rank whose rollout another rank's engine serves (a TP group's follower, `served_by`) holds
  what that engine holds: its trainer's digest is checked against that engine's.
- The first mismatch in rank order is the one named; within a rank, its TP workers in order,
  then its engine's own digest (a worker names more than the engine does).
- `[checks] on_weights_mismatch` says what a mismatch does (`ON_MISMATCH`): "fail" (the
  default) ends the cycle naming it, since every sample the rollout draws is then off-policy;
  "warn" goes on, and says so loudly every step it happens.

- Which tensor differs: each side keeps its per-tensor lines of the last version (name ->
  "dtype|shape|hash", engines/digest.py), asked for only once a digest differs; the first name
  in sorted order whose lines differ is named (`tensor_difference`), with how many others do.
  Lines that cannot be had (a worker that reported nothing, a side that did not answer) leave
  it unknown, and the error says why.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

OnMismatch = Literal["fail", "warn"]
# One side's per-tensor lines of a version: name -> "dtype|shape|hash of the bytes".
Table = Mapping[str, str]


class Verdict(enum.Enum):
    HOLDS = "holds"  # every rollout holds its trainer's weights
    WARN = "warn"  # one does not: the cycle goes on, and says so
    FAIL = "fail"  # one does not: the cycle ends, naming it


# What a mismatch does, by `[checks] on_weights_mismatch`.
ON_MISMATCH: dict[OnMismatch, Verdict] = {"fail": Verdict.FAIL, "warn": Verdict.WARN}


@dataclass(frozen=True)
class RankSync:
    """What one rank's SYNC reported. `sent`: the digest of the weights its trainer sent (or,
    served by another rank's engine, produced); `receivers`: the TP workers its trainer's
    session went to (0: it sent nothing); `held`: its rollout engine's digest; `workers`: each
    TP worker's (worker, digest), as reported; `served_by`: the rank whose engine serves it."""

    rank: int
    sent: str
    receivers: int
    held: str
    workers: tuple[tuple[int, str], ...] = ()
    served_by: int | None = None


@dataclass(frozen=True)
class Mismatch:
    """The first rollout found not holding its trainer's weights: `rank`'s, held by the engine
    of `engine_rank` (itself unless served); `worker` is the TP worker of that engine that
    differs, sent no report, or should not be there (None: the engine's own digest differs);
    `expected` the trainer's digest, `found` the one reported (None: no report)."""

    rank: int
    engine_rank: int
    worker: int | None
    workers: int
    expected: str
    found: str | None
    what: str  # the mismatch in words
    tensor: str | None = None  # the first tensor that differs, in words (None: not known)
    unknown: str = "its lines were not asked for"  # why `tensor` is not known

    def __str__(self) -> str:
        if self.tensor is not None:
            return f"{self.what}; the first tensor that differs: {self.tensor}"
        return f"{self.what}; which tensor differs is not known: {self.unknown}"

    def named(self, sent: Table, held: Table) -> Mismatch:
        """This mismatch with its first differing tensor, from the trainer's lines (`sent`)
        and those of the rollout's engine or TP worker found differing (`held`)."""
        difference = tensor_difference(sent, held)
        if difference is None:  # both sides' lines agree: the whole digests were of others
            why = "both sides' per-tensor lines agree (they were of another version?)"
            return dataclasses.replace(self, unknown=why)
        return dataclasses.replace(self, tensor=difference)

    def not_named(self, why: str) -> Mismatch:
        return dataclasses.replace(self, unknown=why)


@dataclass(frozen=True)
class Judged:
    verdict: Verdict
    mismatch: Mismatch | None = None


def judge_weights(syncs: Sequence[RankSync], on_mismatch: OnMismatch) -> Judged:
    """The step's SYNC, every rank of `syncs` reported: what the cycle does."""
    mismatch = first_mismatch(syncs)
    if mismatch is None:
        return Judged(Verdict.HOLDS)
    return Judged(ON_MISMATCH[on_mismatch], mismatch)


def first_mismatch(syncs: Sequence[RankSync]) -> Mismatch | None:
    """The first rank (in rank order) whose rollout does not hold what its trainer sent."""
    by_rank = {sync.rank: sync for sync in syncs}
    for sync in sorted(syncs, key=lambda s: s.rank):
        if sync.served_by is None:
            found = _engine_mismatch(sync.rank, sync.sent, sync, f"rollout rank {sync.rank}")
        else:
            leader = sync.served_by
            where = f"rank {sync.rank}'s rollout (rank {leader}'s engine serves it)"
            engine = by_rank.get(leader)
            if engine is None:
                what = f"{where}: no SYNC report of rank {leader}'s engine came"
                return Mismatch(sync.rank, leader, None, 0, sync.sent, None, what)
            found = _engine_mismatch(sync.rank, sync.sent, engine, where)
        if found is not None:
            return found
    return None


def _engine_mismatch(rank: int, expected: str, engine: RankSync, where: str) -> Mismatch | None:
    """Whether the engine of `engine.rank` holds `expected` (the trainer of `rank` sent it)."""
    size = engine.receivers

    def mismatch(worker: int | None, found: str | None, what: str) -> Mismatch:
        return Mismatch(rank, engine.rank, worker, size, expected, found, f"{where}: {what}")

    if engine.workers or size != 1:
        held = dict(engine.workers)
        reported = sorted(held)
        for worker in range(size):
            if worker not in held:
                return mismatch(
                    worker,
                    None,
                    f"TP worker {worker} of {size} sent no report of what it loaded (reports "
                    f"came from workers {reported}); the trainer sent {expected}",
                )
            if held[worker] != expected:
                return mismatch(
                    worker,
                    held[worker],
                    f"TP worker {worker} of {size} holds {held[worker]}, not the {expected} "
                    "its trainer sent",
                )
        counts = Counter(worker for worker, _ in engine.workers)
        for worker, count in sorted(counts.items()):
            if worker not in range(size):
                what = f"a report came from TP worker {worker}, of an engine of {size} workers"
                return mismatch(worker, held[worker], what)
            if count > 1:
                what = f"TP worker {worker} of {size} reported {count} times, not once"
                return mismatch(worker, held[worker], what)
    if engine.held != expected:
        return mismatch(
            None,
            engine.held,
            f"the engine holds {engine.held}, not the {expected} its trainer sent",
        )
    return None


def tensor_difference(sent: Table, held: Table) -> str | None:
    """The first tensor, in name order, whose line differs between what the trainer sent and
    what the rollout holds, in words, with how many more differ; None when all agree."""
    differing = sorted(
        name for name in sent.keys() | held.keys() if sent.get(name) != held.get(name)
    )
    if not differing:
        return None
    name = differing[0]
    more = len(differing) - 1
    also = f" ({more} more of {len(sent.keys() | held.keys())} differ)" if more else ""
    return _line_difference(name, sent.get(name), held.get(name)) + also


def _line_difference(name: str, sent: str | None, held: str | None) -> str:
    if held is None:
        return f"{name} was sent and the rollout never loaded it"
    if sent is None:
        return f"{name} was loaded by the rollout and the trainer never sent it"
    sent_dtype, sent_shape, _ = _fields(sent)
    held_dtype, held_shape, _ = _fields(held)
    if sent_dtype != held_dtype:
        return f"{name} was sent as {sent_dtype} and is held as {held_dtype}"
    if sent_shape != held_shape:
        return f"{name} was sent with shape {sent_shape} and is held with shape {held_shape}"
    return f"{name} ({sent_dtype}, shape {sent_shape}): its bytes differ"


def _fields(line: str) -> tuple[str, str, str]:
    """(dtype, shape, hash) of a table's line; a line of another form is all hash."""
    parts = line.split("|")
    if len(parts) != 3:
        return "", "", line
    return parts[0], parts[1], parts[2]
