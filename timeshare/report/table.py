"""The per-phase table of a run: what `timeshare report RUN_DIR --text` prints.

Each phase's time in a step is its slowest rank's (as the summary keeps it); the table gives
its median, p90 and max over the run's steps, then the step itself, the sync rate, and the
bubble (the part of a step no engine worked: fence waits and orchestration) as a share of the
step. p90 is the nearest-rank percentile: a value some step really took.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from timeshare.cycle.steps import PHASES, StepFigures


@dataclass(frozen=True)
class Spread:
    median: float
    p90: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        ordered = sorted(values)
        p90 = ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)]
        return cls(statistics.median(ordered), p90, ordered[-1])


@dataclass(frozen=True)
class PhaseTable:
    steps: tuple[int, int]  # first and last
    ranks: int
    phases: dict[str, Spread]  # seconds; the phases, then "step"
    sync_gbps: Spread
    bubble_share: float  # of the run's step time, 0..1
    # the largest trainer/rollout logprob difference, and the drift probe's, of any step (None:
    # not measured)
    logprob_diff: float | None = None
    drift: float | None = None
    # the completions' mean length (tokens), truncated share and TRAIN's padding share, each
    # over the run's steps (None: not measured)
    completion_tokens: Spread | None = None
    truncated: Spread | None = None
    padding: Spread | None = None


def phase_table(steps: Sequence[StepFigures], ranks: int) -> PhaseTable:
    phases = {p: Spread.of([s.phases[p] for s in steps]) for p in PHASES}
    phases["step"] = Spread.of([s.step_s for s in steps])
    total = sum(s.step_s for s in steps)
    return PhaseTable(
        steps=(steps[0].step, steps[-1].step),
        ranks=ranks,
        phases=phases,
        sync_gbps=Spread.of([s.sync.gbps for s in steps]),
        bubble_share=sum(s.bubble_s for s in steps) / total if total > 0 else 0.0,
        logprob_diff=_largest([s.logprob_max_abs_diff for s in steps]),
        drift=_largest([s.invariance_max_abs_diff for s in steps]),
        **_length_spreads(steps),
    )


def _length_spreads(steps: Sequence[StepFigures]) -> dict[str, Spread]:
    measured = [s.lengths for s in steps if s.lengths is not None]
    if not measured:
        return {}
    return {
        "completion_tokens": Spread.of([m.completion_tokens_mean for m in measured]),
        "truncated": Spread.of([m.truncated_fraction for m in measured]),
        "padding": Spread.of([m.padding_share for m in measured]),
    }


def _largest(values: Sequence[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return max(measured) if measured else None


def render(table: PhaseTable, title: str) -> str:
    first, last = table.steps
    lines = [
        f"{title}: steps {first}-{last} ({last - first + 1}), {table.ranks} ranks",
        f"{'phase':<9}{'median ms':>11}{'p90 ms':>10}{'max ms':>10}",
    ]
    for name, spread in table.phases.items():
        lines.append(
            f"{name:<9}{spread.median * 1e3:>11.1f}{spread.p90 * 1e3:>10.1f}"
            f"{spread.max * 1e3:>10.1f}"
        )
    rate = table.sync_gbps
    lines.append(f"sync     {rate.median:.3f} GB/s median, {rate.p90:.3f} p90, {rate.max:.3f} max")
    lines.append(f"bubble   {table.bubble_share * 100:.1f} % of the step time")
    if table.logprob_diff is not None:
        lines.append(f"logprobs trainer/rollout differ by {table.logprob_diff:.1e} at most")
    if table.drift is not None:
        lines.append(f"drift    a sequence alone / in its batch: {table.drift:.1e} at most")
    if table.completion_tokens is not None:
        tokens = table.completion_tokens
        lines.append(
            f"completion {tokens.median:.1f} tokens median of the steps' means, "
            f"{tokens.max:.1f} max"
        )
    if table.truncated is not None and table.padding is not None:
        lines.append(
            f"truncated {table.truncated.median:.0%} median, {table.truncated.max:.0%} max; "
            f"padding {table.padding.median:.0%} of TRAIN's tokens median"
        )
    return "\n".join(lines) + "\n"
