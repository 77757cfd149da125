"""How a front end watches and steers a running cycle, what it is told, and what a run returns.

`timeshare run` watches the phases that ended (for its per-step summary); the service also
follows every transition, supplies live deadlines (a reload changes them) and keeps no history
(it runs for days).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from timeshare.config import DeadlineSection
from timeshare.protocols.commands.results import BootstrapResult, PhaseResult
from timeshare.protocols.nodes import NodeRecord
from timeshare.state import JobState, Phase


@dataclass(frozen=True)
class PhaseReport:
    """One rank's run of one phase (both workers): when and how long, and what each returned."""

    step: int  # the job's step as the phase started (TRAIN of step s makes weight version s)
    rank: int
    phase: Phase
    started: float  # time.monotonic() as the phase started
    seconds: float  # to its end; BARRIER's includes the wait for every rank
    trainer: PhaseResult
    rollout: PhaseResult


@dataclass(frozen=True)
class BootstrapReport:
    """One rank's trainer loaded the last committed checkpoint (the job resumes at `step`)."""

    step: int
    rank: int
    trainer: BootstrapResult


# Awaited by the driver, one report at a time: it must not block the event loop.
PhaseObserver = Callable[[PhaseReport | BootstrapReport], Awaitable[None]]
# Called with the job's state after every transition; synchronous, so it must return at once.
StateObserver = Callable[[JobState], None]
NodesObserver = Callable[[list[NodeRecord]], None]
# The deadlines in force now: a service reloads them while the cycle runs.
DeadlineSource = Callable[[], DeadlineSection]


@dataclass(frozen=True)
class CycleHooks:
    """How a front end watches and steers a running cycle (all optional)."""

    observer: PhaseObserver | None = None  # every phase that ended well
    on_state: StateObserver | None = None  # every transition
    deadlines: DeadlineSource | None = None  # else the config's, fixed
    keep_reports: bool = True  # False for a service: memory must not grow with the steps
    # Commands of the job store after this generation apply to the run (None: from its start).
    commands_from: int | None = None
    on_nodes: NodesObserver | None = None  # several nodes: every node's record, every beat


@dataclass
class RunSummary:
    """How a run ended (STOPPED: it drained), and, with `keep_reports`, what every phase did."""

    lifecycle: str
    step: int
    reason: str | None
    cycle_seconds: float = 0.0  # from the end of bootstrap to the stop
    first_step: int = 0  # the step the checkpoint held at bootstrap
    stop_requested: bool = False  # a `stop` of the job store ended it (given on any node)
    phase_seconds: dict[str, list[float]] = field(default_factory=dict)
    reports: list[PhaseReport] = field(default_factory=list)  # in the order phases ended


class Telling:
    """Tells a front end what its hooks ask for, and keeps the run's summary."""

    def __init__(self, hooks: CycleHooks) -> None:
        self.hooks = hooks
        self.summary = RunSummary(lifecycle="starting", step=0, reason=None)

    def state(self, state: JobState) -> None:
        if self.hooks.on_state is not None:
            self.hooks.on_state(state)

    def nodes(self, records: list[NodeRecord]) -> None:
        if self.hooks.on_nodes is not None:
            self.hooks.on_nodes(records)

    async def bootstrapped(self, report: BootstrapReport) -> None:
        if self.hooks.observer is not None:
            await self.hooks.observer(report)

    async def phase_ended(self, report: PhaseReport) -> None:
        if self.hooks.keep_reports:
            self.summary.phase_seconds.setdefault(report.phase.value, []).append(report.seconds)
            self.summary.reports.append(report)
        if self.hooks.observer is not None:
            await self.hooks.observer(report)

    def stopped(self, state: JobState, cycle_seconds: float) -> RunSummary:
        summary = self.summary
        summary.lifecycle, summary.step, summary.reason = (
            state.lifecycle.value,
            state.step,
            state.reason,
        )
        summary.cycle_seconds = cycle_seconds
        return summary
