"""The weights check, performed: once every rank of this node has reported a step's SYNC, whether
each rollout holds what its trainer sent (state/weights.py decides, here as for the step's
`weights_match` figure) and, if one does not, what `[checks] on_weights_mismatch` says: the
run's failure, or a warning.

It runs at the end of SYNC, before RESUME and ROLLOUT, so that under "fail" no sample is drawn
from weights other than the trainer's; the step's TRAIN is committed by then, so the run keeps
it (a restart resumes there). A tensor-parallel group's engine and the ranks it serves are on
one node (the config requires it), so a node's reports are enough.

A mismatch names the first tensor that differs: the two sides' per-tensor lines of the version
(`tables`, a worker command asked for only then: they are kept where they were hashed, never
sent every step) are compared by state/weights.py. What cannot be had within TABLES_S (each
side's, one after the other) leaves it unknown, saying why; the verdict stands either way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import structlog

from timeshare.cycle.phases import cycle_failed
from timeshare.cycle.steps import rank_syncs
from timeshare.cycle.workers import Workers
from timeshare.errors import CycleFailed, TimeshareError, WeightsMismatch
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.commands.results import CommandResult, SyncResult, TablesResult
from timeshare.state import Phase
from timeshare.state.weights import Mismatch, OnMismatch, Verdict, judge_weights

log = structlog.get_logger(__name__)

# For both sides' per-tensor lines, once a mismatch is found: kept in memory where they were
# hashed, answered at once; a side busy past this (or gone) leaves the tensor unknown.
TABLES_S = 30.0


class WeightsCheck:
    """Collects each step's SYNC results of `ranks` (global numbers: this node's) and checks
    them once all are in."""

    def __init__(self, ranks: Sequence[int], on_mismatch: OnMismatch, workers: Workers) -> None:
        self.ranks = ranks
        self.on_mismatch = on_mismatch
        self.workers = workers
        # step -> rank -> (trainer's, rollout's): a step's entry goes once every rank reported
        self._pending: dict[int, dict[int, tuple[SyncResult, SyncResult]]] = defaultdict(dict)

    async def synced(
        self, step: int, rank: int, trainer: CommandResult, rollout: CommandResult
    ) -> CycleFailed | None:
        """`rank` ended SYNC of `step`: the run's failure if that completed the step's SYNC and
        a rollout does not hold its trainer's weights (under "fail")."""
        if not isinstance(trainer, SyncResult) or not isinstance(rollout, SyncResult):
            raise TypeError(f"SYNC of rank {rank} answered {trainer!r} and {rollout!r}")
        reports = self._pending[step]
        reports[rank] = (trainer, rollout)
        if len(reports) < len(self.ranks):
            return None
        del self._pending[step]
        ranks = sorted(reports)
        sent, received = [reports[r][0] for r in ranks], [reports[r][1] for r in ranks]
        judged = judge_weights(rank_syncs(ranks, sent, received), self.on_mismatch)
        if judged.verdict is Verdict.HOLDS or judged.mismatch is None:
            return None
        version = reports[judged.mismatch.rank][0].transfer.version  # what its trainer sent
        mismatch = await self.named(version, judged.mismatch)
        if judged.verdict is Verdict.WARN:
            log.warning(  # every step it happens: loud, as the samples are off-policy
                "cycle.weights.mismatch",
                step=step,
                rank=mismatch.rank,
                worker=mismatch.worker,
                on_weights_mismatch=self.on_mismatch,
                error=str(mismatch),
            )
            return None
        cause = WeightsMismatch(str(mismatch), rank=mismatch.rank, worker=mismatch.worker)
        return cycle_failed(mismatch.rank, "rollout", Phase.SYNC.value, cause)

    async def named(self, version: int, mismatch: Mismatch) -> Mismatch:
        """`mismatch` with the first tensor that differs, from the per-tensor lines of its
        trainer and of its rollout's engine (or the TP worker found differing)."""
        if mismatch.found is None:
            return mismatch.not_named("the rollout side reported nothing for it")
        try:
            sent = await self._tables(WorkerId("trainer", mismatch.rank), version)
            held = await self._tables(WorkerId("rollout", mismatch.engine_rank), version)
        except TimeshareError as exc:  # WorkerFailure included: the verdict stands without
            return mismatch.not_named(f"the per-tensor lines could not be had: {exc}")
        if mismatch.worker is None:
            return mismatch.named(sent.tensors, held.tensors)
        lines = held.workers.get(mismatch.worker)
        if lines is None:
            why = f"TP worker {mismatch.worker} kept no per-tensor lines of the version"
            return mismatch.not_named(why)
        return mismatch.named(sent.tensors, lines)

    async def _tables(self, worker: WorkerId, version: int) -> TablesResult:
        tables = await self.workers.call(
            worker, "tables", deadline_s=TABLES_S, returns=TablesResult
        )
        if tables.version != version:
            raise TimeshareError(
                f"{worker.role} {worker.rank} answered with the lines of version "
                f"{tables.version}, not {version}'s"
            )
        return tables
