"""Telling a front end what happened: its hooks, the run's summary, and the timeline's records
(each also logged: `timeshare trace` rebuilds the trace from the log)."""

from __future__ import annotations

import math

import msgspec

from timeshare.cycle.hooks import BootstrapReport, CycleHooks, PhaseReport, RunSummary
from timeshare.cycle.records import Figure, MarkRecord, PhaseRecord, Record, log_record
from timeshare.protocols.commands.results import (
    CommandResult,
    RolloutResult,
    SyncResult,
    TrainResult,
)
from timeshare.protocols.nodes import NodeSeen
from timeshare.state import JobState
from timeshare.timing import Clock, process_clock


class Telling:
    """Tells a front end what its hooks ask for, and keeps the run's summary."""

    def __init__(self, hooks: CycleHooks, node: int = 0) -> None:
        self.hooks = hooks
        self.node = node
        self.clock = process_clock()
        self.summary = RunSummary(lifecycle="starting", step=0, reason=None)

    def state(self, state: JobState) -> None:
        if self.hooks.on_state is not None:
            self.hooks.on_state(state)

    def nodes(self, records: list[NodeSeen]) -> None:
        if self.hooks.on_nodes is not None:
            self.hooks.on_nodes(records)

    async def bootstrapped(self, report: BootstrapReport) -> None:
        if self.hooks.observer is not None:
            await self.hooks.observer(report)

    async def phase_ended(self, report: PhaseReport) -> None:
        if self.hooks.keep_reports:
            self.summary.phase_seconds.setdefault(report.phase.value, []).append(report.seconds)
            self.summary.reports.append(report)
        self._record(phase_record(report, self.node, self.clock))
        if self.hooks.observer is not None:
            await self.hooks.observer(report)

    def mark(self, name: str, at: float, **args: Figure) -> None:
        """A moment of the driver's (`at`: time.monotonic()) on the timeline."""
        self._record(MarkRecord(node=self.node, name=name, at=at, clock=self.clock, args=args))

    def stopped(self, state: JobState, cycle_seconds: float) -> RunSummary:
        summary = self.summary
        summary.lifecycle, summary.step, summary.reason = (
            state.lifecycle.value,
            state.step,
            state.reason,
        )
        summary.cycle_seconds = cycle_seconds
        return summary

    def _record(self, record: Record) -> None:
        log_record(record)
        if self.hooks.on_record is not None:
            self.hooks.on_record(record)


def phase_record(report: PhaseReport, node: int, clock: Clock) -> PhaseRecord:
    return PhaseRecord(
        node=node,
        rank=report.rank,
        phase=report.phase.value,
        step=report.step,
        version=_version(report),
        start=report.started,
        seconds=report.seconds,
        answered=report.answered,
        clock=clock,
        figures=_figures("trainer", report.trainer) | _figures("rollout", report.rollout),
        trainer=report.trainer.spans,
        rollout=report.rollout.spans,
    )


def _version(report: PhaseReport) -> int:
    for result in (report.trainer, report.rollout):
        if isinstance(result, TrainResult):
            return result.figures.step
        if isinstance(result, SyncResult):
            return result.transfer.version
        if isinstance(result, RolloutResult) and result.version is not None:
            return result.version
    return report.step


def _figures(role: str, result: CommandResult) -> dict[str, Figure]:
    """The plain figures of a result (not its spans, samples or per-bucket lists), a SYNC's
    transfer's and a TRAIN's figures among its own. A loss gone to NaN stays visible, as the
    string "nan": JSON has no NaN and trace viewers refuse one."""
    fields = msgspec.structs.asdict(result)
    if isinstance(result, SyncResult):
        fields = msgspec.structs.asdict(result.transfer) | fields
        for worker in result.workers:  # a TP engine: what reached each worker's loader
            fields[f"worker{worker.worker}.bytes"] = worker.bytes
            fields[f"worker{worker.worker}.digest"] = worker.digest
    if isinstance(result, TrainResult):
        fields = msgspec.structs.asdict(result.figures) | fields
    return {
        f"{role}.{name}": str(value)
        if isinstance(value, float) and not math.isfinite(value)
        else value
        for name, value in fields.items()
        if isinstance(value, float | int | str | bool) or value is None
    }
