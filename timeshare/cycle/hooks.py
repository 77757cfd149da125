"""How a front end watches and steers a running cycle, what it is told, and what a run returns.

`timeshare run` watches the phases that ended (for its per-step summary); the service also
follows every transition, supplies live deadlines (a reload changes them) and keeps no history
(it runs for days).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from timeshare.config import DeadlineSection
from timeshare.cycle.records import Record
from timeshare.protocols.commands.results import BootstrapResult, CommandResult
from timeshare.state import JobState, Phase

if TYPE_CHECKING:  # protocols.nodes imports torch.distributed: a report's reader needs neither
    from timeshare.protocols.nodes import NodeSeen


@dataclass(frozen=True)
class PhaseReport:
    """One rank's run of one phase (both workers): when and how long, and what each returned
    (their `CommandResult`s), as a front end's observer is told (records.py's `PhaseRecord` is
    the same phase as the timeline logs it)."""

    step: int  # the job's step as the phase started (TRAIN of step s makes weight version s)
    rank: int
    phase: Phase
    started: float  # time.monotonic() as the phase started
    seconds: float  # to its end; BARRIER's includes the wait for every rank
    trainer: CommandResult
    rollout: CommandResult
    answered: float  # time.monotonic() as both had answered (BARRIER: before the wait)


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
NodesObserver = Callable[[list["NodeSeen"]], None]
# Every record of the run's timeline (records.py); synchronous, so it must return at once.
RecordObserver = Callable[[Record], None]
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
    on_record: RecordObserver | None = None  # the timeline: every phase of a rank, every mark


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
