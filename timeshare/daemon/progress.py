"""What the service knows of its job from the cycle: committed step, weights, the last step.

Fed with the cycle's reports, in memory only (the driver awaits it between phases): a step is
committed when every rank's TRAIN answered with it committed (each trainer checkpoints before
it answers); a weight version is served when every rank's SYNC answered; a step's figures
(cycle/steps.py, the same as `timeshare run --summary` writes) are complete once every rank ran
its six phases, and are then logged as the one summary line per cycle. Each call returns the
journal entries it produced; the service writes them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import msgspec
import structlog

from timeshare.cycle.hooks import BootstrapReport, PhaseReport
from timeshare.cycle.steps import StepFigures, StepLog
from timeshare.daemon.metrics import Metrics
from timeshare.daemon.records import journal_entry, read_progress
from timeshare.protocols.commands.results import SyncResult, TrainResult
from timeshare.report.scalars import ScalarWriter
from timeshare.state import Phase

log = structlog.get_logger(__name__)


class SavedProgress(msgspec.Struct, frozen=True):
    """What progress.json holds (every field may be missing in an old or a first file)."""

    committed_step: int | None = None
    weight_version: int | None = None
    last_step: dict[str, object] | None = None


def load_saved_progress(state_dir: Path) -> SavedProgress:
    """What the last daemon wrote (nothing, for a first start or a file it cannot read)."""
    try:
        return msgspec.convert(read_progress(state_dir), SavedProgress)
    except msgspec.ValidationError:
        return SavedProgress()


class JobProgress:
    def __init__(
        self,
        ranks: Sequence[int],
        metrics: Metrics,
        saved: SavedProgress,
        scalars: ScalarWriter | None = None,
    ) -> None:
        self.ranks = ranks  # this node's
        self.scalars = scalars
        self.metrics = metrics
        self.committed_step = saved.committed_step
        self.weight_version = saved.weight_version
        self.last_step = saved.last_step
        self._steps = StepLog(ranks)
        self._finished: Counter[tuple[int, Phase]] = Counter()  # ranks done with a step's phase

    def snapshot(self) -> SavedProgress:
        return SavedProgress(self.committed_step, self.weight_version, self.last_step)

    def bootstrapped(self, report: BootstrapReport) -> list[dict[str, object]]:
        """A rank's trainer loaded the checkpoint of `report.step` (0: none yet)."""
        last = self.last_step.get("step", 0) if self.last_step is not None else None
        known = isinstance(last, int) and last >= report.step
        if not known:
            self._steps.resume(report)  # finish that step's figures if a crash cut it short
        if report.rank != self.ranks[0]:
            return []
        if report.step > 0:
            self.committed_step = report.step
            self.metrics.committed_step.set(report.step)
        return [journal_entry("bootstrapped", step=report.step)]

    def cycle_ended(self) -> None:
        self._steps.clear()  # steps a stopped cycle left unfinished are not reported
        self._finished.clear()

    def phase_ended(self, report: PhaseReport) -> list[dict[str, object]]:
        self.metrics.phase_ended(report.phase, report.seconds)
        if report.phase is Phase.SYNC and isinstance(report.trainer, SyncResult):
            sent = report.trainer.transfer
            self.metrics.synced(sent.bytes, sent.seconds, list(sent.ack_seconds), sent.version)
        entries = self._every_rank(report)
        figures = self._steps.add(report)
        if figures is not None:
            self.metrics.stepped(figures)
            self.last_step = msgspec.to_builtins(figures)
            if self.scalars is not None:
                self.scalars.add(figures)  # queued: the writer's thread writes
            self._log_step(figures)
            entries.append(journal_entry("step.done", step=figures.step, figures=self.last_step))
        return entries

    def _every_rank(self, report: PhaseReport) -> list[dict[str, object]]:
        """Journal entries of a phase every rank has now finished."""
        key = (report.step, report.phase)
        self._finished[key] += 1
        if self._finished[key] < len(self.ranks):
            return []
        del self._finished[key]
        trainer = report.trainer
        if isinstance(trainer, TrainResult) and trainer.figures.committed is not None:
            self.committed_step = report.step  # every rank checkpointed before answering
            self.metrics.committed_step.set(report.step)
            return [journal_entry("step.committed", step=report.step)]
        if isinstance(report.trainer, SyncResult):
            self.weight_version = report.trainer.transfer.version
            return [journal_entry("weights.synced", step=report.step, version=self.weight_version)]
        return []

    def _log_step(self, figures: StepFigures) -> None:
        reward = figures.reward_mean
        log.info(  # the one summary line per cycle
            "cycle.step.done",
            step=figures.step,
            committed_step=self.committed_step,
            weight_version=self.weight_version,
            reward_mean=None if reward is None else round(reward, 4),
            sync_gbps=round(figures.sync.gbps, 4),
            **{f"{phase}_s": round(seconds, 4) for phase, seconds in figures.phases.items()},
        )
