"""`timeshare run CONFIG`: the cycle in the foreground, with progress and a per-step summary.

On a terminal one status line is redrawn (step, phase, reward, sync GB/s); otherwise one plain
line per step. Events go to the config's log file as JSON lines. SIGINT and SIGTERM stop the run
at once with every worker killed; a later run resumes from the last committed step.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio

from timeshare.config import Config
from timeshare.daemon.driver import (
    BootstrapRecord,
    CycleHooks,
    PhaseRecord,
    RunSummary,
    run_cycle,
)
from timeshare.daemon.steps import StepLog, SummaryFile


@dataclass
class Progress:
    """What the operator sees while the run goes on."""

    steps: int
    out: TextIO
    tty: bool
    reward: float | None = None
    gbps: float | None = None
    drawn: bool = field(default=False)

    def phase(self, record: PhaseRecord) -> None:
        if self.tty:
            self._draw(f"phase {record.phase.value:<8} rank {record.rank}", record.step)

    def step(self, entry: dict[str, Any]) -> None:
        self.reward, self.gbps = entry["reward_mean"], entry["sync"]["gbps"]
        if self.tty:
            self._draw("", entry["step"])
            return
        print(
            f"step {entry['step']:>4}/{self.steps}  reward {entry['reward_mean']:.3f}  "
            f"step {entry['step_s']:.2f} s  sync {entry['sync']['gbps']:.3f} GB/s  "
            f"weights_match {entry['weights_match']}  "
            f"logprob_diff {entry['logprob_max_abs_diff']:.1e}",
            file=self.out,
            flush=True,
        )

    def close(self) -> None:
        if self.tty and self.drawn:
            print(file=self.out, flush=True)

    def _draw(self, detail: str, step: int) -> None:
        done = min(step, self.steps)
        bar = "#" * (20 * done // max(self.steps, 1))
        reward = "-" if self.reward is None else f"{self.reward:.3f}"
        gbps = "-" if self.gbps is None else f"{self.gbps:.3f}"
        line = f"[{bar:<20}] step {step}/{self.steps} {detail} reward {reward} sync {gbps} GB/s"
        self.out.write(f"\r{line:<100}")
        self.out.flush()
        self.drawn = True


async def run_foreground(config: Config, summary_path: Path | None) -> RunSummary:
    progress = Progress(config.job.steps, sys.stdout, sys.stdout.isatty())
    summary = SummaryFile(summary_path, config.job.ranks) if summary_path else None

    steps = StepLog(config.job.ranks)
    writing = anyio.Lock()  # one summary write at a time (ranks finish phases concurrently)

    async def observe(record: PhaseRecord | BootstrapRecord) -> None:
        if isinstance(record, PhaseRecord):
            progress.phase(record)
            entry = steps.add(record)
            if entry is not None:
                if summary is not None:
                    async with writing:  # fsync: off the event loop
                        await anyio.to_thread.run_sync(summary.append, entry)
                progress.step(entry)
            return
        # Bootstrapped at the committed step: keep what the summary says up to it, and finish
        # that step here if a crash cut it short after its TRAIN.
        if summary is not None and record.rank == 0:
            async with writing:
                await anyio.to_thread.run_sync(summary.resume_from, record.step)
        if summary is None or not summary.has(record.step):
            steps.resume(record)

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(_stop_on_signal)
            result = await run_cycle(config, hooks=CycleHooks(observer=observe))
            group.cancel_scope.cancel()
    except BaseExceptionGroup as errors:
        raise _first(errors) from None  # one failure or one signal: say it plainly
    finally:
        progress.close()
    return result


def _first(errors: BaseExceptionGroup[BaseException]) -> BaseException:
    error: BaseException = errors
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


async def _stop_on_signal() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            raise Interrupted(signum)


class Interrupted(Exception):
    """The run was asked to stop by a signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
