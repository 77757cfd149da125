"""The phase machine: every legal move of a timeshare job, as one table and one pure function.

Rules (the table below is the truth; this comment explains it):

- A job's lifecycle is STARTING → RUNNING ⇄ PAUSED → DRAINING → STOPPED; any live state → FAILED.
- STARTING ends with `Bootstrapped`: the last durable checkpoint is loaded and every rank enters
  SYNC, so the engines always serve the trainer's weights (SYNC → BARRIER → RESUME → ROLLOUT →
  TRAIN → OFFLOAD → SYNC …).
- Each rank moves through the phases on its own (`RankFinished`), except into a *fenced* phase,
  which a rank enters only when every rank has finished the phase before it. Fences sit on the
  memory handoffs: SYNC (engine weights wake) after every OFFLOAD; RESUME (KV cache wakes) after
  every BARRIER; TRAIN (trainer onloads) after every ROLLOUT, whose end means engines slept and
  their release was verified. `fences` can drop one, for the test that proves it matters.
- Requests set flags; they take effect at safe points, which are the fenced boundaries, where
  the whole job stands at one place: drain there → DRAINING; at the cycle boundary (before
  TRAIN) pause → PAUSED, and a job that has done `max_steps` drains. `stop` does not wait: it
  drains at once. Flags are a set, so repeating a request changes nothing.
- `StepsChanged` (a reload) moves `max_steps`; it is checked at the next cycle boundary, and
  by a resume from PAUSED, so a job paused at its new limit drains instead of starting a step.
- An event the table does not allow raises `InvalidTransition(state, event)` and changes
  nothing. No I/O here: the driver performs what this decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TypeAlias

from timeshare.errors import TimeshareError


class Lifecycle(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class Phase(enum.Enum):
    TRAIN = "train"
    OFFLOAD = "offload"
    SYNC = "sync"
    BARRIER = "barrier"
    RESUME = "resume"
    ROLLOUT = "rollout"


class Request(enum.Enum):
    PAUSE = "pause"
    RESUME = "resume"
    DRAIN = "drain"
    STOP = "stop"


NEXT_PHASE: dict[Phase, Phase] = {
    Phase.TRAIN: Phase.OFFLOAD,
    Phase.OFFLOAD: Phase.SYNC,
    Phase.SYNC: Phase.BARRIER,
    Phase.BARRIER: Phase.RESUME,
    Phase.RESUME: Phase.ROLLOUT,
    Phase.ROLLOUT: Phase.TRAIN,
}
FIRST_PHASE = Phase.SYNC  # where bootstrap enters the cycle
CYCLE_START = Phase.TRAIN  # entering it starts a new step; the boundary before it is the cycle's
# Phases a rank enters only once every rank has finished the one before: the memory handoffs.
MEMORY_FENCES: frozenset[Phase] = frozenset({Phase.SYNC, Phase.RESUME, Phase.TRAIN})


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bootstrapped:
    """Workers are up and the last durable checkpoint (of `step`) is loaded."""

    step: int


@dataclass(frozen=True)
class RankFinished:
    """`rank` finished `phase` (the driver saw its worker report success)."""

    rank: int
    phase: Phase


@dataclass(frozen=True)
class Requested:
    """An operator asked for pause, resume, drain or stop."""

    request: Request


@dataclass(frozen=True)
class StepsChanged:
    """The operator reloaded a config with a new number of steps for the job."""

    max_steps: int


@dataclass(frozen=True)
class Drained:
    """The driver finished draining: engines asleep, progress persisted."""


@dataclass(frozen=True)
class Failed:
    """Something failed that the job cannot go on from (a typed error, in words)."""

    error: str


Event: TypeAlias = Bootstrapped | RankFinished | Requested | StepsChanged | Drained | Failed


# -- state -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankProgress:
    """Where one rank stands: in `phase`, or done with it and waiting at a fence."""

    phase: Phase
    done: bool = False


@dataclass(frozen=True)
class JobState:
    lifecycle: Lifecycle
    ranks: tuple[RankProgress, ...]
    step: int = 0  # the step the job is in (incremented on entering TRAIN)
    max_steps: int | None = None
    requests: frozenset[Request] = frozenset()
    fences: frozenset[Phase] = MEMORY_FENCES
    reason: str | None = None  # why the job is draining, stopped or failed

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(r.phase for r in self.ranks)


def initial_state(
    ranks: int, *, max_steps: int | None = None, fences: frozenset[Phase] = MEMORY_FENCES
) -> JobState:
    """A job that is starting: workers not yet up, nothing loaded."""
    if ranks < 1:
        raise ValueError(f"a job needs at least one rank, got {ranks}")
    if not fences <= MEMORY_FENCES:
        raise ValueError(f"fences must be a subset of {sorted(p.value for p in MEMORY_FENCES)}")
    progress = tuple(RankProgress(FIRST_PHASE) for _ in range(ranks))
    return JobState(Lifecycle.STARTING, progress, max_steps=max_steps, fences=fences)


class InvalidTransition(TimeshareError):
    """Raised when an event is not legal in the job's state; the state is unchanged."""

    def __init__(self, state: JobState, event: Event, why: str = "not allowed") -> None:
        super().__init__(
            f"{type(event).__name__} {_describe(event)} in {state.lifecycle.value}: {why}"
        )
        self.state = state
        self.event = event


# -- the table -------------------------------------------------------------------------------

# (lifecycle, event type) -> the lifecycles it may lead to. A pair missing here is illegal.
TABLE: dict[tuple[Lifecycle, type], frozenset[Lifecycle]] = {
    (Lifecycle.STARTING, Bootstrapped): frozenset({Lifecycle.RUNNING, Lifecycle.DRAINING}),
    (Lifecycle.STARTING, Requested): frozenset({Lifecycle.STARTING, Lifecycle.DRAINING}),
    (Lifecycle.RUNNING, RankFinished): frozenset(
        {Lifecycle.RUNNING, Lifecycle.PAUSED, Lifecycle.DRAINING}
    ),
    (Lifecycle.RUNNING, Requested): frozenset({Lifecycle.RUNNING, Lifecycle.DRAINING}),
    (Lifecycle.PAUSED, Requested): frozenset(
        {Lifecycle.PAUSED, Lifecycle.RUNNING, Lifecycle.DRAINING}
    ),
    (Lifecycle.DRAINING, Requested): frozenset({Lifecycle.DRAINING}),
    (Lifecycle.DRAINING, RankFinished): frozenset({Lifecycle.DRAINING}),
    (Lifecycle.DRAINING, Drained): frozenset({Lifecycle.STOPPED}),
    **{
        (lifecycle, StepsChanged): frozenset({lifecycle})
        for lifecycle in (
            Lifecycle.STARTING,
            Lifecycle.RUNNING,
            Lifecycle.PAUSED,
            Lifecycle.DRAINING,
        )
    },
    **{
        (lifecycle, Failed): frozenset({Lifecycle.FAILED})
        for lifecycle in (
            Lifecycle.STARTING,
            Lifecycle.RUNNING,
            Lifecycle.PAUSED,
            Lifecycle.DRAINING,
        )
    },
}


@dataclass(frozen=True)
class Outcome:
    """The next state and what the driver must start: (rank, phase) pairs, in rank order."""

    state: JobState
    start: tuple[tuple[int, Phase], ...] = field(default=())


def advance(state: JobState, event: Event) -> Outcome:
    """The pure transition function: the state after `event`, and the phases to start."""
    allowed = TABLE.get((state.lifecycle, type(event)))
    if allowed is None:
        raise InvalidTransition(state, event)
    outcome = _apply(state, event)
    assert outcome.state.lifecycle in allowed, (state, event, outcome)  # the table is the truth
    return outcome


def _apply(state: JobState, event: Event) -> Outcome:
    if isinstance(event, Failed):
        return Outcome(replace(state, lifecycle=Lifecycle.FAILED, reason=event.error))
    if isinstance(event, Drained):
        return Outcome(replace(state, lifecycle=Lifecycle.STOPPED))
    if isinstance(event, Requested):
        return _request(state, event)
    if isinstance(event, StepsChanged):
        if event.max_steps < 1:
            raise InvalidTransition(state, event, "a job has at least one step")
        return Outcome(replace(state, max_steps=event.max_steps))
    if isinstance(event, Bootstrapped):
        return _bootstrap(state, event)
    return _rank_finished(state, event)


def _bootstrap(state: JobState, event: Bootstrapped) -> Outcome:
    if event.step < 0:
        raise InvalidTransition(state, event, "a step is never negative")
    ranks = tuple(RankProgress(FIRST_PHASE) for _ in state.ranks)
    booted = replace(state, ranks=ranks, step=event.step)
    if Request.DRAIN in state.requests or Request.STOP in state.requests:
        return Outcome(_draining(booted, "drain requested during start-up"))
    running = replace(booted, lifecycle=Lifecycle.RUNNING)
    return Outcome(running, tuple((rank, FIRST_PHASE) for rank in range(len(ranks))))


def _request(state: JobState, event: Requested) -> Outcome:
    request = event.request
    if request is Request.STOP:
        if state.lifecycle is Lifecycle.DRAINING:
            return Outcome(state)
        return Outcome(_draining(state, "stop requested"))
    if request is Request.RESUME:
        return _resume(state, event)
    if state.lifecycle is Lifecycle.PAUSED and request is Request.DRAIN:
        return Outcome(_draining(state, "drain requested while paused"))
    if state.lifecycle in (Lifecycle.PAUSED, Lifecycle.DRAINING):
        return Outcome(state)  # pausing a paused job, draining a draining one: nothing to do
    return Outcome(replace(state, requests=state.requests | {request}))


def _resume(state: JobState, event: Requested) -> Outcome:
    if state.lifecycle is Lifecycle.DRAINING:
        raise InvalidTransition(state, event, "a draining job cannot resume")
    if state.lifecycle is Lifecycle.PAUSED:
        if state.max_steps is not None and state.step >= state.max_steps:
            return Outcome(_draining(state, f"completed {state.max_steps} steps"))
        return _enter_cycle(replace(state, lifecycle=Lifecycle.RUNNING))
    return Outcome(replace(state, requests=state.requests - {Request.PAUSE}))


def _rank_finished(state: JobState, event: RankFinished) -> Outcome:
    if not 0 <= event.rank < len(state.ranks):
        raise InvalidTransition(state, event, f"the job has ranks 0..{len(state.ranks) - 1}")
    progress = state.ranks[event.rank]
    if progress.phase is not event.phase or progress.done:
        where = f"{progress.phase.value}{' (done)' if progress.done else ''}"
        raise InvalidTransition(state, event, f"rank {event.rank} is in {where}")
    following = NEXT_PHASE[event.phase]
    if state.lifecycle is Lifecycle.DRAINING or following in state.fences:
        return _arrive_at_fence(_mark_done(state, event.rank), following)
    ranks = _set(state.ranks, event.rank, RankProgress(following))
    return Outcome(replace(state, ranks=ranks), ((event.rank, following),))


def _arrive_at_fence(state: JobState, following: Phase) -> Outcome:
    """A rank waits at a fence; the last one to arrive decides for the whole job (safe point)."""
    if state.lifecycle is Lifecycle.DRAINING or not all(r.done for r in state.ranks):
        return Outcome(state)
    if Request.DRAIN in state.requests:
        return Outcome(_draining(state, "drain requested"))
    if following is CYCLE_START:
        if state.max_steps is not None and state.step >= state.max_steps:
            return Outcome(_draining(state, f"completed {state.max_steps} steps"))
        if Request.PAUSE in state.requests:
            paused = replace(state, lifecycle=Lifecycle.PAUSED)
            return Outcome(replace(paused, requests=paused.requests - {Request.PAUSE}))
        return _enter_cycle(state)
    return _start_all(state, following)


def _enter_cycle(state: JobState) -> Outcome:
    """Every rank starts TRAIN of the next step."""
    return _start_all(replace(state, step=state.step + 1), CYCLE_START)


def _start_all(state: JobState, phase: Phase) -> Outcome:
    ranks = tuple(RankProgress(phase) for _ in state.ranks)
    return Outcome(replace(state, ranks=ranks), tuple((r, phase) for r in range(len(ranks))))


def _mark_done(state: JobState, rank: int) -> JobState:
    progress = state.ranks[rank]
    return replace(state, ranks=_set(state.ranks, rank, RankProgress(progress.phase, done=True)))


def _draining(state: JobState, reason: str) -> JobState:
    return replace(state, lifecycle=Lifecycle.DRAINING, requests=frozenset(), reason=reason)


def _set(
    ranks: tuple[RankProgress, ...], index: int, value: RankProgress
) -> tuple[RankProgress, ...]:
    return (*ranks[:index], value, *ranks[index + 1 :])


def _describe(event: Event) -> str:
    if isinstance(event, RankFinished):
        return f"(rank {event.rank}, {event.phase.value})"
    if isinstance(event, Requested):
        return f"({event.request.value})"
    if isinstance(event, Bootstrapped):
        return f"(step {event.step})"
    if isinstance(event, StepsChanged):
        return f"(max_steps {event.max_steps})"
    return ""
