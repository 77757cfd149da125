"""The weights check, performed: once every rank of this node has reported a step's SYNC, whether
each rollout holds what its trainer sent (state/weights.py decides, here as for the step's
`weights_match` figure) and, if one does not, what `[checks] on_weights_mismatch` says: the
run's failure, or a warning.

It runs at the end of SYNC, before RESUME and ROLLOUT, so that under "fail" no sample is drawn
from weights other than the trainer's; the step's TRAIN is committed by then, so the run keeps
it (a restart resumes there). A tensor-parallel group's engine and the ranks it serves are on
one node (the config requires it), so a node's reports are enough.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import structlog

from timeshare.cycle.phases import cycle_failed
from timeshare.cycle.steps import rank_syncs
from timeshare.errors import CycleFailed, WeightsMismatch
from timeshare.protocols.commands.results import CommandResult, SyncResult
from timeshare.state import Phase
from timeshare.state.weights import OnMismatch, Verdict, judge_weights

log = structlog.get_logger(__name__)


class WeightsCheck:
    """Collects each step's SYNC results of `ranks` (global numbers: this node's) and checks
    them once all are in."""

    def __init__(self, ranks: Sequence[int], on_mismatch: OnMismatch) -> None:
        self.ranks = ranks
        self.on_mismatch = on_mismatch
        # step -> rank -> (trainer's, rollout's): a step's entry goes once every rank reported
        self._pending: dict[int, dict[int, tuple[SyncResult, SyncResult]]] = defaultdict(dict)

    def synced(
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
        mismatch = judged.mismatch
        if judged.verdict is Verdict.HOLDS or mismatch is None:
            return None
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
