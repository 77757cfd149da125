"""`timeshare run CONFIG`: the cycle in the foreground, with progress and a per-step summary.

On a terminal one status line is redrawn (step, phase, reward, sync GB/s); otherwise one plain
line per step. Events go to the config's log file as JSON lines. SIGINT and SIGTERM stop the run
at once with every worker killed; a later run resumes from the last committed step.
"""

from __future__ import annotations

import signal
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import anyio

from timeshare.cluster import node_ranks
from timeshare.config import Config
from timeshare.cycle.hooks import (
    BootstrapReport,
    CycleHooks,
    PhaseObserver,
    PhaseReport,
    RunSummary,
)
from timeshare.cycle.runner import run_cycle
from timeshare.cycle.steps import StepFigures, StepLog
from timeshare.errors import Interrupted, first_error
from timeshare.protocols.commands.results import LengthFigures
from timeshare.report.summary import SummaryFile
from timeshare.report.writers import RunWriters, open_writers


def _lengths(lengths: LengthFigures | None) -> str:
    """The completions' lengths on the step line ("" where not measured)."""
    if lengths is None:
        return ""
    return (
        f"  completion {lengths.completion_tokens_mean:.1f}/{lengths.completion_tokens_max} "
        f"tokens (mean/max)  truncated {lengths.truncated_fraction:.0%}  "
        f"padding {lengths.padding_share:.0%}"
    )


@dataclass
class Progress:
    """What the operator sees while the run goes on."""

    steps: int
    out: TextIO
    tty: bool
    reward: float | None = None
    gbps: float | None = None
    drawn: bool = field(default=False)

    def phase(self, report: PhaseReport) -> None:
        if self.tty:
            self._draw(f"phase {report.phase.value:<8} rank {report.rank}", report.step)

    def step(self, figures: StepFigures) -> None:
        self.reward, self.gbps = figures.reward_mean, figures.sync.gbps
        if self.tty:
            self._draw("", figures.step)
            return
        print(
            f"step {figures.step:>4}/{self.steps}  reward {_number(figures.reward_mean, '.3f')}  "
            f"step {figures.step_s:.2f} s  sync {figures.sync.gbps:.3f} GB/s  "
            f"weights_match {figures.weights_match}  "
            f"logprob_diff {_number(figures.logprob_max_abs_diff, '.1e')}"
            + (
                f"  drift {figures.invariance_max_abs_diff:.1e}"
                if figures.invariance_max_abs_diff is not None
                else ""
            )
            + _lengths(figures.lengths)
            + (
                f"  val_reward {figures.val_reward_mean:.3f}"
                if figures.val_reward_mean is not None
                else ""
            )
            + (
                f"  skipped {figures.rewards.skipped_fraction:.1%}"
                if figures.rewards is not None and figures.rewards.skipped_fraction
                else ""
            )
            + (
                f"  resident {figures.rollout_resident_mb:.0f} MiB"
                if figures.rollout_resident_mb
                else ""
            ),
            file=self.out,
            flush=True,
        )

    def close(self) -> None:
        if self.tty and self.drawn:
            print(file=self.out, flush=True)

    def _draw(self, detail: str, step: int) -> None:
        done = min(step, self.steps)
        bar = "#" * (20 * done // max(self.steps, 1))
        reward, gbps = _number(self.reward, ".3f"), _number(self.gbps, ".3f")
        line = f"[{bar:<20}] step {step}/{self.steps} {detail} reward {reward} sync {gbps} GB/s"
        self.out.write(f"\r{line:<100}")
        self.out.flush()
        self.drawn = True


async def run_foreground(config: Config, summary_path: Path | None, name: str = "") -> RunSummary:
    """Run `config` (called `name`, its file's stem) to its end, `summary_path` if given."""
    async with AsyncExitStack() as opened:  # the writers closed on every way out
        writers = await open_writers(config.log, opened)
        progress = Progress(config.job.steps, sys.stdout, sys.stdout.isatty())
        summary = SummaryFile(summary_path, config.job.ranks, name) if summary_path else None
        observe = _observer(config, summary, writers, progress)
        trace = writers.trace
        hooks = CycleHooks(
            observer=observe,
            on_record=None if trace is None else trace.add,
            keep_reports=False,  # every report is told as it comes: memory must not grow with steps
        )
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_stop_on_signal)
                result = await run_cycle(config, hooks=hooks)
                group.cancel_scope.cancel()
        except BaseExceptionGroup as errors:
            raise first_error(errors) from None  # one failure or one signal: say it plainly
        finally:
            progress.close()
    return result


def _observer(
    config: Config, summary: SummaryFile | None, writers: RunWriters, progress: Progress
) -> PhaseObserver:
    """What `timeshare run` does with each report: progress, the summary, the scalars."""
    ranks = node_ranks(config.cluster, config.job.ranks)  # this node's: it reports their steps
    steps = StepLog(ranks)
    writing = anyio.Lock()  # one summary write at a time (ranks finish phases concurrently)

    async def observe(report: PhaseReport | BootstrapReport) -> None:
        if isinstance(report, PhaseReport):
            progress.phase(report)
            figures = steps.add(report)
            if figures is not None:
                if summary is not None:
                    async with writing:  # fsync: off the event loop
                        await anyio.to_thread.run_sync(summary.append, figures)
                if writers.scalars is not None:
                    writers.scalars.add(figures)  # queued: the writer's thread writes
                progress.step(figures)
            return
        # Bootstrapped at the committed step: keep what the summary says up to it, and finish
        # that step here if a crash cut it short after its TRAIN.
        if summary is not None and report.rank == ranks.start:
            async with writing:
                await anyio.to_thread.run_sync(summary.resume_from, report.step)
        if summary is None or not summary.has(report.step):
            steps.resume(report)

    return observe


async def _stop_on_signal() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            raise Interrupted(signum)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
