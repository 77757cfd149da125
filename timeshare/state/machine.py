"""The phase machine: every legal move of a timeshare job, as one table and one pure function.

Rules (the table below is the truth; this comment explains it):

- A job's lifecycle is STARTING → RUNNING ⇄ PAUSED → DRAINING → STOPPED; any live state → FAILED.
  A failure the driver saw (a worker raised, died, stalled, timed out) comes in as `Failed`; a
  failure the rules find (memory still held where it must be free) is decided here. Either way
  the job is FAILED, with the reason and the worker to blame.
- STARTING ends with `Bootstrapped`: the last durable checkpoint is loaded and every rank enters
  SYNC, so the engines always serve the trainer's weights (SYNC → BARRIER → RESUME → ROLLOUT →
  TRAIN → OFFLOAD → SYNC …).
- Each rank moves through the phases on its own (`RankFinished`), except into a *fenced* phase,
  which a rank enters only when every rank has finished the phase before it. Fences sit on the
  memory handoffs: SYNC (engine weights wake) after every OFFLOAD; RESUME (KV cache wakes) after
  every BARRIER; TRAIN (trainer onloads) after every ROLLOUT, whose end means engines slept.
  `fences` can drop one, for the test that proves it matters.
- With several nodes, each node's machine holds its own ranks, and the fences hold across
  nodes: when its last rank arrives at a fence, the node waits for every other node there
  (`Outcome.cross`), and decides only once `Crossed` says all came.
- An operator's command comes as `Commanded` (read from the job store, in generation order).
  On one node it applies at once. On several it is held (`JobState.held`) until the next
  crossing, which applies those up to the newest generation any node had seen (`through`),
  the same on every node: every node pauses, drains, stops or goes on at the same step. While
  PAUSED (every node stands at the same place) commands apply at once, and those held when the
  pause took effect apply then. `applies_at_once` is that rule.
- BARRIER requires the rank's trainer to hold no device memory (`BarrierChecked`): anything held
  fails the job. Then, while RESUME is fenced, the rank meets every other rank of its node
  (`Outcome.meet`: the driver, which runs them all, holds the meeting) and finishes BARRIER
  when all came; with several nodes, the nodes then cross before RESUME, as at every fence.
- Requests set flags; they take effect at safe points, which are the fenced boundaries, where
  the whole job stands at one place: drain there → DRAINING; at the cycle boundary (before
  TRAIN) a job that has done `max_steps` drains, and a pause first has every worker's release
  checked (`Outcome.check_release`, answered by `PauseChecked`): PAUSED means released and
  verified, and memory still held fails the job. `stop` does not wait: it drains at once, and
  ranks at the node's meeting stop waiting (no RESUME follows). Flags are a set, so
  repeating a request changes nothing.
- `StepsChanged` (a reload) moves `max_steps`; it is checked at the next cycle boundary, and
  by a resume from PAUSED, so a job paused at its new limit drains instead of starting a step.
- A draining job is drained when no rank has work in flight (`JobState.idle`).
- An event the table does not allow raises `InvalidTransition(state, event)` and changes
  nothing. No I/O here: the driver performs what this decides (plan.py says how).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from timeshare.errors import InvalidTransition
from timeshare.state.events import (
    BarrierChecked,
    Blame,
    Bootstrapped,
    Commanded,
    Crossed,
    Drained,
    Event,
    Failed,
    Lifecycle,
    PauseChecked,
    Phase,
    RankFinished,
    Request,
    Requested,
    StepsChanged,
    describe,
)
from timeshare.state.job import (
    CYCLE_START,
    FIRST_PHASE,
    LIVE,
    NEXT_PHASE,
    JobState,
    RankProgress,
)


def refuse(state: JobState, event: Event, why: str = "not allowed") -> InvalidTransition:
    """The error for `event` in `state`, naming both."""
    return InvalidTransition(
        f"{type(event).__name__} {describe(event)} in {state.lifecycle.value}: {why}",
        state=state,
        event=event,
    )


# -- the table -------------------------------------------------------------------------------

# (lifecycle, event type) -> the lifecycles it may lead to. A pair missing here is illegal.
TABLE: dict[tuple[Lifecycle, type], frozenset[Lifecycle]] = {
    (Lifecycle.STARTING, Bootstrapped): frozenset({Lifecycle.RUNNING, Lifecycle.DRAINING}),
    (Lifecycle.STARTING, Requested): frozenset({Lifecycle.STARTING, Lifecycle.DRAINING}),
    (Lifecycle.RUNNING, RankFinished): frozenset({Lifecycle.RUNNING, Lifecycle.DRAINING}),
    (Lifecycle.RUNNING, BarrierChecked): frozenset({Lifecycle.RUNNING, Lifecycle.FAILED}),
    (Lifecycle.RUNNING, PauseChecked): frozenset(
        {Lifecycle.RUNNING, Lifecycle.PAUSED, Lifecycle.DRAINING, Lifecycle.FAILED}
    ),
    (Lifecycle.RUNNING, Crossed): frozenset({Lifecycle.RUNNING, Lifecycle.DRAINING}),
    (Lifecycle.RUNNING, Requested): frozenset({Lifecycle.RUNNING, Lifecycle.DRAINING}),
    (Lifecycle.PAUSED, Requested): frozenset(
        {Lifecycle.PAUSED, Lifecycle.RUNNING, Lifecycle.DRAINING}
    ),
    (Lifecycle.DRAINING, Requested): frozenset({Lifecycle.DRAINING}),
    (Lifecycle.DRAINING, RankFinished): frozenset({Lifecycle.DRAINING}),
    (Lifecycle.DRAINING, BarrierChecked): frozenset({Lifecycle.DRAINING, Lifecycle.FAILED}),
    (Lifecycle.DRAINING, PauseChecked): frozenset({Lifecycle.DRAINING, Lifecycle.FAILED}),
    (Lifecycle.DRAINING, Drained): frozenset({Lifecycle.STOPPED}),
    **{(lifecycle, StepsChanged): frozenset({lifecycle}) for lifecycle in LIVE},
    # A command held is no move; one applied moves as its Requested or StepsChanged does.
    (Lifecycle.STARTING, Commanded): frozenset({Lifecycle.STARTING, Lifecycle.DRAINING}),
    (Lifecycle.RUNNING, Commanded): frozenset({Lifecycle.RUNNING, Lifecycle.DRAINING}),
    (Lifecycle.PAUSED, Commanded): frozenset(
        {Lifecycle.PAUSED, Lifecycle.RUNNING, Lifecycle.DRAINING}
    ),
    (Lifecycle.DRAINING, Commanded): frozenset({Lifecycle.DRAINING}),
    **{(lifecycle, Failed): frozenset({Lifecycle.FAILED}) for lifecycle in LIVE},
}


@dataclass(frozen=True)
class Outcome:
    """The next state, and what the driver must now do because of this event.

    `start`: (rank, phase) pairs to run, in rank order. `meet`: ranks whose BARRIER passed its
    memory check and who now wait for every rank at the node's meeting. `check_release`: ask
    every worker what device memory it holds, and answer with `PauseChecked`. `cross`: wait for
    every other node at the fence before this phase, and answer with `Crossed`.
    """

    state: JobState
    start: tuple[tuple[int, Phase], ...] = field(default=())
    meet: tuple[int, ...] = field(default=())
    check_release: bool = False
    cross: Phase | None = None
    refused: tuple[str, ...] = ()  # held commands the job could not take when released


def advance(state: JobState, event: Event) -> Outcome:
    """The pure transition function: the state after `event`, and what it asks of the driver."""
    allowed = TABLE.get((state.lifecycle, type(event)))
    if allowed is None:
        raise refuse(state, event)
    outcome = _apply(state, event)
    assert outcome.state.lifecycle in allowed, (state, event, outcome)  # the table is the truth
    return outcome


def _apply(state: JobState, event: Event) -> Outcome:
    apply: Callable[[JobState, Any], Outcome] = _APPLY[type(event)]
    return apply(state, event)


def _fail(state: JobState, event: Failed) -> Outcome:
    return Outcome(_failed(state, event.error, event.blame))


def _drained(state: JobState, event: Drained) -> Outcome:
    if not state.idle:
        raise refuse(state, event, "work is still in flight")
    return Outcome(replace(state, lifecycle=Lifecycle.STOPPED))


def _steps_changed(state: JobState, event: StepsChanged) -> Outcome:
    if event.max_steps < 1:
        raise refuse(state, event, "a job has at least one step")
    return Outcome(replace(state, max_steps=event.max_steps))


def _bootstrap(state: JobState, event: Bootstrapped) -> Outcome:
    if event.step < 0:
        raise refuse(state, event, "a step is never negative")
    booted = replace(state, step=event.step)
    if Request.DRAIN in state.requests or Request.STOP in state.requests:
        return Outcome(_draining(booted, "drain requested during start-up"))
    running = replace(booted, lifecycle=Lifecycle.RUNNING)
    return _start_all(running, FIRST_PHASE)


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
        raise refuse(state, event, "a draining job cannot resume")
    if state.lifecycle is Lifecycle.PAUSED:
        if state.max_steps is not None and state.step >= state.max_steps:
            return Outcome(_draining(state, f"completed {state.max_steps} steps"))
        return _enter_cycle(replace(state, lifecycle=Lifecycle.RUNNING))
    return Outcome(replace(state, requests=state.requests - {Request.PAUSE}))


def _rank_finished(state: JobState, event: RankFinished) -> Outcome:
    progress = _working_rank(state, event, event.rank, event.phase)
    if event.phase is Phase.BARRIER and not progress.meeting:
        raise refuse(state, event, f"rank {event.rank} has not passed its BARRIER memory check")
    return _finish(state, event.rank)


def _barrier_checked(state: JobState, event: BarrierChecked) -> Outcome:
    progress = _working_rank(state, event, event.rank, Phase.BARRIER)
    if progress.meeting:
        raise refuse(state, event, f"rank {event.rank} was already checked")
    if event.held_mb > 0:
        rank = state.first_rank + event.rank
        blame = Blame(rank, "trainer", Phase.BARRIER.value)
        held = f"trainer still holds {event.held_mb:g} MiB of device memory at BARRIER"
        return Outcome(_failed(state, f"trainer rank {rank}: {held}", blame))
    if state.lifecycle is Lifecycle.RUNNING and Phase.RESUME in state.fences:
        meeting = RankProgress(Phase.BARRIER, meeting=True)
        return Outcome(
            replace(state, ranks=_set(state.ranks, event.rank, meeting)), meet=(event.rank,)
        )
    return _finish(state, event.rank)  # draining (no RESUME follows), or the fence is dropped


def _pause_checked(state: JobState, event: PauseChecked) -> Outcome:
    if not state.checking_release:
        raise refuse(state, event, "no release check is under way")
    checked = replace(state, checking_release=False)
    holding = [held for held in event.held if held.mb > 0]
    if holding:
        listed = ", ".join(f"{h.role} rank {h.rank}: {h.mb:g}" for h in holding)
        blame = Blame(holding[0].rank, holding[0].role, "pause")
        return Outcome(
            _failed(checked, f"paused, but device memory is still held (MiB): {listed}", blame)
        )
    if checked.lifecycle is Lifecycle.DRAINING:
        return Outcome(checked)
    if Request.PAUSE in checked.requests and Request.DRAIN not in checked.requests:
        paused = replace(checked, lifecycle=Lifecycle.PAUSED)
        # paused everywhere: what waited for a crossing applies now
        return _release_held(replace(paused, requests=paused.requests - {Request.PAUSE}), None)
    return _decide_at_fence(checked, CYCLE_START)  # a drain or a resume came during the check


def _crossed(state: JobState, event: Crossed) -> Outcome:
    if state.crossing is not event.following:
        where = "no fence" if state.crossing is None else f"the fence before {state.crossing.value}"
        raise refuse(state, event, f"this node waits at {where}")
    released = _release_held(state, event.through)
    if released.state.crossing is not event.following:
        return released  # a stop among them: no phase follows
    decided = _decide_at_fence(replace(released.state, crossing=None), event.following)
    return _merged(released, decided)


def applies_at_once(state: JobState) -> bool:
    """Whether an operator's command read now goes to the machine at once.

    One node: always (the machine takes requests at any time and acts at the next fence).
    Several: a node reads the job store's commands a little before or after another, so a
    command could land on either side of a fence; it waits for the next crossing instead.
    `stop` too: one node stopping at once while another has crossed would leave that one alone
    in a phase whose collectives wait for the first (it still takes effect within a phase).
    While PAUSED, every node stands at the same place: at once.
    """
    return state.nodes == 1 or state.lifecycle is Lifecycle.PAUSED


def _commanded(state: JobState, event: Commanded) -> Outcome:
    if applies_at_once(state):
        return advance(state, event.command)  # refused, it is refused as itself
    return Outcome(replace(state, held=(*state.held, event)))


def _release_held(state: JobState, through: int | None) -> Outcome:
    """The held commands up to generation `through` (None: all), in order, as if each came
    now; one the job cannot take now (a resume while draining) is refused and dropped."""
    release = [c for c in state.held if through is None or c.generation <= through]
    outcome = Outcome(replace(state, held=tuple(c for c in state.held if c not in release)))
    for command in release:
        try:
            outcome = _merged(outcome, advance(outcome.state, command.command))
        except InvalidTransition as exc:
            outcome = replace(outcome, refused=(*outcome.refused, str(exc)))
    return outcome


def _merged(first: Outcome, then: Outcome) -> Outcome:
    """Two moves made one after the other, as one: the last state, every action of both."""
    return Outcome(
        then.state,
        start=first.start + then.start,
        meet=first.meet + then.meet,
        check_release=first.check_release or then.check_release,
        cross=then.cross or first.cross,
        refused=first.refused + then.refused,
    )


def _working_rank(state: JobState, event: Event, rank: int, phase: Phase) -> RankProgress:
    """The rank's progress, if it is working in `phase`; else the event is refused."""
    if not 0 <= rank < len(state.ranks):
        raise refuse(state, event, f"the job has ranks 0..{len(state.ranks) - 1}")
    progress = state.ranks[rank]
    if progress.phase is not phase or progress.done:
        where = f"{progress.phase.value}{' (done)' if progress.done else ''}"
        raise refuse(state, event, f"rank {rank} is in {where}")
    return progress


def _finish(state: JobState, rank: int) -> Outcome:
    """`rank` finished its phase: on to the next one, or wait at a fence (or for the drain)."""
    following = NEXT_PHASE[state.ranks[rank].phase]
    if state.lifecycle is Lifecycle.DRAINING or following in state.fences:
        waiting = _set(state.ranks, rank, RankProgress(state.ranks[rank].phase, done=True))
        return _arrive_at_fence(replace(state, ranks=waiting), following)
    ranks = _set(state.ranks, rank, RankProgress(following))
    return Outcome(replace(state, ranks=ranks), ((rank, following),))


def _arrive_at_fence(state: JobState, following: Phase) -> Outcome:
    """A rank waits at a fence; the last one to arrive decides for the whole job (safe point)."""
    if state.lifecycle is Lifecycle.DRAINING or not all(r.done for r in state.ranks):
        return Outcome(state)
    if state.nodes > 1:
        return Outcome(replace(state, crossing=following), cross=following)
    return _decide_at_fence(state, following)


def _decide_at_fence(state: JobState, following: Phase) -> Outcome:
    """Every rank stands at the fence before `following`: drain, pause, stop, or go on."""
    if Request.DRAIN in state.requests:
        return Outcome(_draining(state, "drain requested"))
    if following is CYCLE_START:
        if state.max_steps is not None and state.step >= state.max_steps:
            return Outcome(_draining(state, f"completed {state.max_steps} steps"))
        if Request.PAUSE in state.requests:
            return Outcome(replace(state, checking_release=True), check_release=True)
        return _enter_cycle(state)
    return _start_all(state, following)


def _enter_cycle(state: JobState) -> Outcome:
    """Every rank starts TRAIN of the next step."""
    return _start_all(replace(state, step=state.step + 1), CYCLE_START)


def _start_all(state: JobState, phase: Phase) -> Outcome:
    ranks = tuple(RankProgress(phase) for _ in state.ranks)
    return Outcome(replace(state, ranks=ranks), tuple((r, phase) for r in range(len(ranks))))


def _draining(state: JobState, reason: str) -> JobState:
    # Ranks meeting at the node's meeting stop waiting, and so does a node waiting for the
    # others at a fence: no phase follows a drain.
    ranks = tuple(replace(r, done=True, meeting=False) if r.meeting else r for r in state.ranks)
    return replace(
        state,
        lifecycle=Lifecycle.DRAINING,
        ranks=ranks,
        requests=frozenset(),
        reason=reason,
        crossing=None,
    )


def _failed(state: JobState, error: str, blame: Blame | None) -> JobState:
    return replace(state, lifecycle=Lifecycle.FAILED, reason=error, blame=blame)


_APPLY: dict[type, Callable[[JobState, Any], Outcome]] = {
    Failed: _fail,
    Drained: _drained,
    Requested: _request,
    StepsChanged: _steps_changed,
    Bootstrapped: _bootstrap,
    BarrierChecked: _barrier_checked,
    PauseChecked: _pause_checked,
    Crossed: _crossed,
    Commanded: _commanded,
    RankFinished: _rank_finished,
}


def _set(
    ranks: tuple[RankProgress, ...], index: int, value: RankProgress
) -> tuple[RankProgress, ...]:
    return (*ranks[:index], value, *ranks[index + 1 :])
