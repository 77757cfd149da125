"""What the service knows of its job from the cycle: committed step, weights, the last step.

Fed with the driver's phase records, in memory only (the driver awaits it between phases): a
step is committed when every rank's TRAIN answered (each trainer checkpoints before it does);
a weight version is served when every rank's SYNC answered; a step's figures are complete
with its last ROLLOUT, and are then logged as the one summary line per cycle. Each call
returns the journal entries it produced; the service writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog

from timeshare.daemon.driver import PhaseRecord
from timeshare.daemon.metrics import Metrics
from timeshare.daemon.records import journal_entry
from timeshare.state import Phase

log = structlog.get_logger(__name__)


@dataclass
class StepFigures:
    """One step as it completes: the slowest rank's time per phase, the sync, the reward."""

    phases: dict[str, float] = field(default_factory=dict)
    done: dict[Phase, int] = field(default_factory=dict)  # ranks that finished each phase
    sync_bytes: int = 0
    sync_s: float = 0.0
    rewards: list[float] = field(default_factory=list)

    def summary(self, step: int) -> dict[str, Any]:
        gbps = self.sync_bytes / self.sync_s / 1e9 if self.sync_s > 0 else None
        reward = sum(self.rewards) / len(self.rewards) if self.rewards else None
        return {"step": step, "phases": self.phases, "sync_gbps": gbps, "reward_mean": reward}


class JobProgress:
    def __init__(self, ranks: int, metrics: Metrics, saved: dict[str, Any]) -> None:
        self.ranks = ranks
        self.metrics = metrics
        self.committed_step: int | None = saved.get("committed_step")
        self.weight_version: int | None = saved.get("weight_version")
        self.last_step: dict[str, Any] | None = saved.get("last_step")
        self._steps: dict[int, StepFigures] = {}

    def snapshot(self) -> dict[str, Any]:
        """What progress.json holds."""
        return {
            "committed_step": self.committed_step,
            "weight_version": self.weight_version,
            "last_step": self.last_step,
        }

    def bootstrapped(self, step: int) -> list[dict[str, Any]]:
        """Every worker loaded the checkpoint of `step` (0: none yet)."""
        if step > 0:
            self.committed_step = step
            self.metrics.committed_step.set(step)
        return [journal_entry("bootstrapped", step=step)]

    def cycle_ended(self) -> None:
        self._steps.clear()  # steps a stopped cycle left unfinished are not reported

    def phase_ended(self, record: PhaseRecord) -> list[dict[str, Any]]:
        self.metrics.phase_ended(record.phase, record.seconds)
        figures = self._steps.setdefault(record.step, StepFigures())
        name = record.phase.value
        figures.phases[name] = max(figures.phases.get(name, 0.0), record.seconds)
        done = figures.done[record.phase] = figures.done.get(record.phase, 0) + 1
        if record.phase is Phase.SYNC:
            self._count_sync(figures, record)
        elif record.phase is Phase.ROLLOUT:
            reward = record.results["rollout"].get("reward_mean")
            if reward is not None:
                figures.rewards.append(float(reward))
        if done < self.ranks:
            return []
        return self._every_rank_finished(record, figures)

    def _count_sync(self, figures: StepFigures, record: PhaseRecord) -> None:
        sent = record.results["trainer"]
        nbytes, seconds = int(sent.get("bytes", 0)), float(sent.get("seconds", 0.0))
        figures.sync_bytes += nbytes
        figures.sync_s = max(figures.sync_s, seconds)
        version = int(sent.get("version", record.step))
        acks = [float(a) for a in sent.get("ack_s", [])]
        self.metrics.synced(nbytes, seconds, acks, version)

    def _every_rank_finished(
        self, record: PhaseRecord, figures: StepFigures
    ) -> list[dict[str, Any]]:
        step = record.step
        if record.phase is Phase.TRAIN and "committed" in record.results["trainer"]:
            self.committed_step = step  # every rank checkpointed before answering
            self.metrics.committed_step.set(step)
            return [journal_entry("step.committed", step=step)]
        if record.phase is Phase.SYNC:
            self.weight_version = int(record.results["trainer"].get("version", step))
            return [journal_entry("weights.synced", step=step, version=self.weight_version)]
        if record.phase is Phase.ROLLOUT:
            self.last_step = self._steps.pop(step).summary(step)
            self._log_step(step, figures)
            return [journal_entry("step.done", step=step, figures=self.last_step)]
        return []

    def _log_step(self, step: int, figures: StepFigures) -> None:
        assert self.last_step is not None
        gbps, reward = self.last_step["sync_gbps"], self.last_step["reward_mean"]
        log.info(  # the one summary line per cycle
            "cycle.step.done",
            step=step,
            committed_step=self.committed_step,
            weight_version=self.weight_version,
            reward_mean=None if reward is None else round(reward, 4),
            sync_gbps=None if gbps is None else round(gbps, 4),
            **{f"{p}_s": round(s, 4) for p, s in figures.phases.items()},
        )
