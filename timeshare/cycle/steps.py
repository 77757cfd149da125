"""One step's figures, from the phase reports: what `timeshare run --summary` writes and what
the service shows, logs and keeps as its last step. One definition of each figure, here.

Step n is TRAIN n (on the samples of weight version n-1), OFFLOAD, SYNC of version n, BARRIER,
RESUME, and the ROLLOUT that samples version n for step n+1. A step is complete when every rank
has run all six of its phases. For each step:

- `reward_mean`: the mean reward of the samples TRAIN n learned from, over ranks (those samples
  were drawn by weight version n-1: `sample_version`). This is the reward of the policy that
  produced the batch, as verl and OpenRLHF report it; None when the task scores nothing.
- `phases`: the wall time of each phase on its slowest rank; `per_rank`: each rank's.
- `sync`: bytes moved by every rank, over the slowest rank's transfer time, as GB/s.
- `weights_match`: every rollout holds exactly the trainer's weights (their digests agree, and
  with tensor parallelism so does every TP worker's, each of them reporting):
  state/weights.py's check, the one the cycle performs at SYNC (`[checks] on_weights_mismatch`:
  "fail" ends the run there, so a step with false is only seen under "warn");
  `ranks_agree`: every rank's trainer sent the same weights; `weights_digest`: theirs (None
  where they differ), for comparing nodes.
- `logprob_max_abs_diff`: the largest difference between the trainer's and the rollout's
  logprobs of the sampled tokens (None: the engine does not measure it).
- `lengths`: the completions TRAIN n learned from, over ranks: their length in tokens (mean,
  max), the part truncated at `max_completion_tokens` (no stop token), the padding share of
  TRAIN's tokens (None: the trainer does not measure it).
- `invariance_max_abs_diff`: the drift probe's ([checks] invariance_every): the largest
  difference between a sequence's logprobs re-scored alone and those its batch sampled, over
  ranks (None: not a probed step).
- `rollout_resident_mb`: memory the rollout engines keep while asleep because their platform
  cannot release it (vLLM on CPU has no sleep mode), summed over ranks; 0 where sleep frees all.
- `bubble_s`: the part of a rank's step spent in no engine call and no transfer (fence waits,
  orchestration), averaged over ranks; `step_s`: the slowest rank's wall time for the step.
- `committed_step`: the step every rank made durable (None: the engine keeps no checkpoints).
- `resumed`: TRAIN n was done before a crash and comes from the checkpoint: a run killed after
  TRAIN k was committed resumes at k and finishes step k as its bootstrap.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TypeVar

import msgspec

from timeshare.cycle.hooks import BootstrapReport, PhaseReport
from timeshare.protocols.commands.results import (
    CommandResult,
    HeldResult,
    LengthFigures,
    RewardFigures,
    RolloutResult,
    SyncResult,
    TrainResult,
)
from timeshare.state import Phase
from timeshare.state.weights import RankSync, first_mismatch
from timeshare.units import gbps

PHASES = [phase.value for phase in Phase]
R = TypeVar("R", bound=CommandResult)


class SyncFigures(msgspec.Struct, frozen=True):
    bytes: int
    seconds: float
    gbps: float


class RankFigures(msgspec.Struct, frozen=True):
    """One rank's step: each phase's seconds; the bytes its trainer sent into its rollout
    engine at SYNC (each byte once, however many workers the engine has), and the bytes that
    reached each tensor-parallel worker's loader (empty: an engine that loads in one process)."""

    rank: int
    phases: dict[str, float]
    sent_bytes: int = 0
    loaded_bytes: list[int] = []


class StepFigures(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    weight_version: int
    sample_version: int
    reward_mean: float | None
    phases: dict[str, float]
    per_rank: list[RankFigures]
    bubble_s: float
    step_s: float
    sync: SyncFigures
    weights_match: bool
    ranks_agree: bool
    logprob_max_abs_diff: float | None
    # memory the rollout engines keep while asleep, all ranks (vLLM without sleep mode: CPU)
    rollout_resident_mb: float
    committed_step: int | None
    resumed: bool
    weights_digest: str | None = None
    # device memory the trainers said they held at BARRIER, all ranks (the rule: none)
    held_at_barrier_mb: float = 0.0
    invariance_max_abs_diff: float | None = None
    lengths: LengthFigures | None = None
    rewards: RewardFigures | None = None  # skipped samples, the reward function's extras
    val_reward_mean: float | None = None  # a validation step's ([engine.task] val_every)


class StepLog:
    """Collects phase reports; `add` returns a step's figures once every rank ran all six.
    `ranks`: how many ranks report (numbered from 0), or which (a node's, of several)."""

    def __init__(self, ranks: int | Sequence[int]) -> None:
        self.ranks = range(ranks) if isinstance(ranks, int) else ranks
        self._pending: dict[int, list[PhaseReport]] = defaultdict(list)
        self._resumed: set[int] = set()  # steps whose TRAIN comes from the checkpoint

    def resume(self, report: BootstrapReport) -> None:
        """Step `report.step` was trained before a crash and ends in this run: seed its TRAIN
        (from the checkpoint's figures) and OFFLOAD (done again by the bootstrap) for the rank.

        Nothing to seed at step 0, or when the engine keeps no figures in its checkpoints.
        """
        train = report.trainer.train
        if train is None:
            return
        now = time.monotonic()
        resumed = TrainResult(figures=train, engine_s=train.train_s)
        idle = CommandResult()
        self._pending[report.step] += [
            PhaseReport(
                report.step,
                report.rank,
                Phase.TRAIN,
                now - train.train_s,
                train.train_s,
                resumed,
                idle,
                answered=now,
            ),
            PhaseReport(report.step, report.rank, Phase.OFFLOAD, now, 0.0, idle, idle, now),
        ]
        self._resumed.add(report.step)

    def add(self, report: PhaseReport) -> StepFigures | None:
        """Take one phase report; the step's figures if this report completed the step."""
        if report.phase is Phase.TRAIN or report.step in self._pending:
            self._pending[report.step].append(report)
        reports = self._pending.get(report.step, [])
        if len(reports) < len(self.ranks) * len(PHASES):
            return None
        del self._pending[report.step]
        resumed = report.step in self._resumed
        self._resumed.discard(report.step)
        return step_figures(report.step, reports, self.ranks, resumed=resumed)

    def clear(self) -> None:
        """Forget steps a stopped cycle left unfinished."""
        self._pending.clear()
        self._resumed.clear()


def _val_reward_mean(rollouts: list[RolloutResult]) -> float | None:
    """The validation prompts' mean reward over every rank's (None: no validation this step)."""
    scored = [(r.val_reward_mean, r.val_samples) for r in rollouts if r.val_reward_mean is not None]
    samples = sum(n for _, n in scored)
    if not scored:
        return None
    if samples == 0:
        return sum(mean for mean, _ in scored) / len(scored)
    return sum(mean * n for mean, n in scored) / samples


def step_figures(
    step: int, reports: list[PhaseReport], ranks: Sequence[int], *, resumed: bool = False
) -> StepFigures:
    by_rank: dict[int, dict[str, PhaseReport]] = defaultdict(dict)
    for report in reports:
        by_rank[report.rank][report.phase.value] = report
    trains = [_as(TrainResult, by_rank[r]["train"].trainer).figures for r in ranks]
    sent = [_as(SyncResult, by_rank[r]["sync"].trainer) for r in ranks]
    received = [_as(SyncResult, by_rank[r]["sync"].rollout) for r in ranks]
    senders = [s for s in sent if s.served_by is None]  # a TP group's engine: its leader sends
    transfer_bytes = sum(s.transfer.bytes for s in senders)
    transfer_s = max(s.transfer.seconds for s in senders)
    rewards = [t.reward_mean for t in trains if t.reward_mean is not None]
    logprob_diffs = [t.logprob_max_abs_diff for t in trains if t.logprob_max_abs_diff is not None]
    rollouts = [_as(RolloutResult, by_rank[r]["rollout"].rollout) for r in ranks]
    drifts = [d for r in rollouts if (d := r.invariance_max_abs_diff) is not None]
    committed = [t.committed for t in trains]
    return StepFigures(
        step=step,
        weight_version=sent[0].transfer.version,
        sample_version=step - 1,
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        phases={p: max(by_rank[r][p].seconds for r in ranks) for p in PHASES},
        per_rank=[
            RankFigures(
                r,
                {p: by_rank[r][p].seconds for p in PHASES},
                0 if out.served_by is not None else out.transfer.bytes,
                [worker.bytes for worker in got.workers],
            )
            for r, out, got in zip(ranks, sent, received, strict=True)
        ],
        bubble_s=sum(_bubble(by_rank[r]) for r in ranks) / len(ranks),
        step_s=max(_wall(by_rank[r]) for r in ranks),
        sync=SyncFigures(transfer_bytes, transfer_s, gbps(transfer_bytes, transfer_s)),
        weights_match=first_mismatch(rank_syncs(ranks, sent, received)) is None,
        ranks_agree=len({s.digest for s in sent}) == 1,
        weights_digest=sent[0].digest if len({s.digest for s in sent}) == 1 else None,
        held_at_barrier_mb=sum(_held(by_rank[r]["barrier"].trainer) for r in ranks),
        logprob_max_abs_diff=max(logprob_diffs) if logprob_diffs else None,
        rollout_resident_mb=sum(r.resident_mb for r in rollouts),
        invariance_max_abs_diff=max(drifts) if drifts else None,
        lengths=LengthFigures.combined([t.lengths for t in trains if t.lengths is not None]),
        rewards=RewardFigures.combined([t.rewards for t in trains if t.rewards is not None]),
        val_reward_mean=_val_reward_mean(rollouts),
        committed_step=None if None in committed else min(c for c in committed if c is not None),
        resumed=resumed,
    )


def rank_syncs(
    ranks: Sequence[int], sent: Sequence[SyncResult], received: Sequence[SyncResult]
) -> list[RankSync]:
    """Each rank's SYNC (its trainer's result, its rollout's), as the weights check reads it."""
    return [
        RankSync(
            rank=rank,
            sent=out.digest,
            receivers=out.receivers,
            held=got.digest,
            workers=tuple((worker.worker, worker.digest) for worker in got.workers),
            served_by=got.served_by,
        )
        for rank, out, got in zip(ranks, sent, received, strict=True)
    ]


def _as(kind: type[R], result: CommandResult) -> R:
    if not isinstance(result, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(result).__name__}")
    return result


def _held(result: CommandResult) -> float:
    return result.held_mb if isinstance(result, HeldResult) else 0.0


def _wall(phases: dict[str, PhaseReport]) -> float:
    start = min(r.started for r in phases.values())
    return max(r.started + r.seconds for r in phases.values()) - start


def _bubble(phases: dict[str, PhaseReport]) -> float:
    """A rank's step less the time its engines worked (each phase: the longer of the two)."""
    working = sum(max(r.trainer.engine_s, r.rollout.engine_s) for r in phases.values())
    return max(_wall(phases) - working, 0.0)
