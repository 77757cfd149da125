"""The phase machine, table-driven: every legal and illegal (lifecycle, event) pair, the cycle,
its fences, the requests at safe points, and a hypothesis state machine over random events."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from timeshare.state import (
    MEMORY_FENCES,
    TABLE,
    BarrierChecked,
    Blame,
    Bootstrapped,
    Commanded,
    Crossed,
    Drained,
    Event,
    Failed,
    Held,
    InvalidTransition,
    JobState,
    Lifecycle,
    PauseChecked,
    Phase,
    RankFinished,
    Request,
    Requested,
    StepsChanged,
    advance,
    initial_state,
)

CYCLE = [Phase.SYNC, Phase.BARRIER, Phase.RESUME, Phase.ROLLOUT, Phase.TRAIN, Phase.OFFLOAD]
# Between two fences every rank of a fenced job stands in the same segment.
SEGMENT = {
    Phase.SYNC: 0,
    Phase.BARRIER: 0,
    Phase.RESUME: 1,
    Phase.ROLLOUT: 1,
    Phase.TRAIN: 2,
    Phase.OFFLOAD: 2,
}


def run(state: JobState, *events: Event) -> JobState:
    for event in events:
        state = advance(state, event).state
    return state


def finish(state: JobState, rank: int) -> JobState:
    """`rank` finishes the phase it is in, as the driver reports it (BARRIER: checked, then met)."""
    phase = state.ranks[rank].phase
    if phase is not Phase.BARRIER:
        return advance(state, RankFinished(rank, phase)).state
    outcome = advance(state, BarrierChecked(rank, held_mb=0.0))
    if outcome.meet:
        return advance(outcome.state, RankFinished(rank, phase)).state
    return outcome.state


def finish_phase(state: JobState) -> JobState:
    """Every rank finishes the phase it is in; at a pause, every worker's release is verified."""
    for rank, progress in enumerate(state.ranks):
        if not progress.done:
            state = finish(state, rank)
    if state.checking_release:
        state = advance(state, PauseChecked(released(len(state.ranks)))).state
    return state


def released(ranks: int) -> tuple[Held, ...]:
    return tuple(Held(role, rank, 0.0) for rank in range(ranks) for role in ("trainer", "rollout"))


def state_in(lifecycle: Lifecycle, ranks: int = 2) -> JobState:
    start = initial_state(ranks)
    running = run(start, Bootstrapped(step=0))
    paused = run(running, Requested(Request.PAUSE))
    while paused.lifecycle is Lifecycle.RUNNING:
        paused = finish_phase(paused)
    draining = run(running, Requested(Request.STOP))
    return {
        Lifecycle.STARTING: start,
        Lifecycle.RUNNING: running,
        Lifecycle.PAUSED: paused,
        Lifecycle.DRAINING: draining,
        Lifecycle.STOPPED: run(finish_phase(draining), Drained()),
        Lifecycle.FAILED: run(running, Failed("boom")),
    }[lifecycle]


def sample_events(state: JobState) -> list[Event]:
    first = state.ranks[0]
    return [
        Bootstrapped(step=3),
        RankFinished(0, first.phase),
        BarrierChecked(0, 0.0),
        PauseChecked(released(len(state.ranks))),
        *(Requested(r) for r in Request),
        StepsChanged(9),
        Drained(),
        Failed("worker 1 died"),
        Crossed(Phase.RESUME),
        Commanded(1, Requested(Request.PAUSE)),
    ]


# Legal pairs whose particular event the rules still refuse, and why.
REFUSED: dict[tuple[Lifecycle, Event], str] = {
    (Lifecycle.DRAINING, Requested(Request.RESUME)): "a draining job cannot resume",
    (Lifecycle.RUNNING, BarrierChecked(0, 0.0)): "rank 0 is in sync",
    (Lifecycle.DRAINING, BarrierChecked(0, 0.0)): "rank 0 is in sync",
    (Lifecycle.RUNNING, PauseChecked(released(2))): "no release check is under way",
    (Lifecycle.DRAINING, PauseChecked(released(2))): "no release check is under way",
    (Lifecycle.DRAINING, Drained()): "work is still in flight",
    (Lifecycle.RUNNING, Crossed(Phase.RESUME)): "this node waits at no fence",
}


@pytest.mark.parametrize("lifecycle", list(Lifecycle), ids=lambda lc: lc.value)
def test_every_pair_is_legal_exactly_when_the_table_says(lifecycle: Lifecycle) -> None:
    state = state_in(lifecycle)
    assert state.lifecycle is lifecycle
    for event in sample_events(state):
        legal = (lifecycle, type(event)) in TABLE
        refused = REFUSED.get((lifecycle, event))
        if legal and refused is None:
            outcome = advance(state, event)
            assert outcome.state.lifecycle in TABLE[(lifecycle, type(event))]
        else:
            with pytest.raises(InvalidTransition) as info:
                advance(state, event)
            assert info.value.state is state and info.value.event == event
            assert lifecycle.value in str(info.value) and type(event).__name__ in str(info.value)
            if refused:
                assert refused in str(info.value)


def test_bootstrap_path_starts_at_sync_and_the_cycle_follows() -> None:
    outcome = advance(initial_state(2), Bootstrapped(step=5))
    assert outcome.state.lifecycle is Lifecycle.RUNNING
    assert outcome.start == ((0, Phase.SYNC), (1, Phase.SYNC))
    state = outcome.state
    seen = []
    for _ in range(6):
        seen.append(state.phases[0])
        state = finish_phase(state)
    assert seen == CYCLE
    assert state.phases == (Phase.SYNC, Phase.SYNC)
    assert state.step == 6  # one TRAIN entered since the checkpoint of step 5


FENCED = sorted(MEMORY_FENCES, key=CYCLE.index)
UNFENCED = sorted(set(Phase) - MEMORY_FENCES, key=CYCLE.index)


@pytest.mark.parametrize("fenced", FENCED, ids=str)
def test_a_fenced_phase_starts_only_when_every_rank_finished_the_one_before(fenced: Phase) -> None:
    state = run(initial_state(3), Bootstrapped(step=0))
    while state.phases[0] is not CYCLE[CYCLE.index(fenced) - 1]:
        state = finish_phase(state)
    first = finish(state, 0)
    second = finish(first, 2)
    assert first.ranks[0].done and second.ranks[2].done  # ranks 0 and 2 wait at the fence
    assert second.phases == state.phases
    assert finish(second, 1).phases == (fenced, fenced, fenced)


@pytest.mark.parametrize("unfenced", UNFENCED, ids=str)
def test_an_unfenced_phase_starts_at_once_per_rank(unfenced: Phase) -> None:
    state = run(initial_state(2), Bootstrapped(step=0))
    while state.phases[1] is not CYCLE[CYCLE.index(unfenced) - 1]:
        state = finish_phase(state)
    before = state.phases[1]
    state = finish(state, 1)
    assert state.phases == (before, unfenced)
    assert not state.ranks[1].done  # started, while rank 0 still works on the phase before


def test_without_a_fence_a_rank_runs_ahead() -> None:
    state = run(initial_state(2, fences=MEMORY_FENCES - {Phase.SYNC}), Bootstrapped(step=0))
    while state.phases[0] is not Phase.OFFLOAD:
        state = finish_phase(state)
    outcome = advance(state, RankFinished(0, Phase.OFFLOAD))
    assert outcome.start == ((0, Phase.SYNC),)  # rank 1 still offloading
    assert outcome.state.phases == (Phase.SYNC, Phase.OFFLOAD)


def test_pause_takes_effect_at_the_cycle_boundary_and_resume_starts_the_next_step() -> None:
    state = run(initial_state(2), Bootstrapped(step=0), Requested(Request.PAUSE))
    assert state.lifecycle is Lifecycle.RUNNING and Request.PAUSE in state.requests
    for _ in range(3):  # sync, barrier, resume: still running
        state = finish_phase(state)
        assert state.lifecycle is Lifecycle.RUNNING
    state = finish_phase(state)  # rollout ends: engines slept, everything released
    assert state.lifecycle is Lifecycle.PAUSED and state.requests == frozenset()
    assert run(state, Requested(Request.PAUSE)) == state  # repeating is harmless
    outcome = advance(state, Requested(Request.RESUME))
    assert outcome.state.lifecycle is Lifecycle.RUNNING
    assert outcome.start == ((0, Phase.TRAIN), (1, Phase.TRAIN))
    assert outcome.state.step == state.step + 1


def test_resume_before_the_boundary_cancels_a_pending_pause() -> None:
    state = run(initial_state(1), Bootstrapped(step=0), Requested(Request.PAUSE))
    state = run(state, Requested(Request.RESUME))
    for _ in range(6):
        state = finish_phase(state)
    assert state.lifecycle is Lifecycle.RUNNING


def test_drain_waits_for_the_next_fence_and_ends_stopped() -> None:
    state = run(initial_state(2), Bootstrapped(step=0))
    state = finish_phase(state)  # in barrier now
    state = run(state, Requested(Request.DRAIN), Requested(Request.DRAIN))
    assert state.lifecycle is Lifecycle.RUNNING
    state = finish_phase(state)  # every rank finished barrier: a fence, a safe point
    assert state.lifecycle is Lifecycle.DRAINING and state.reason == "drain requested"
    stopped = run(state, Drained())
    assert stopped.lifecycle is Lifecycle.STOPPED


def test_stop_drains_at_once_and_in_flight_phases_may_still_finish() -> None:
    state = run(initial_state(2), Bootstrapped(step=0), Requested(Request.STOP))
    assert state.lifecycle is Lifecycle.DRAINING and state.reason == "stop requested"
    outcome = advance(state, RankFinished(0, Phase.SYNC))
    assert outcome.start == ()  # nothing new starts while draining
    assert run(outcome.state, Requested(Request.STOP)) == outcome.state


def test_the_job_drains_after_max_steps() -> None:
    state = run(initial_state(2, max_steps=2), Bootstrapped(step=0))
    while state.lifecycle is Lifecycle.RUNNING:
        state = finish_phase(state)
    assert state.lifecycle is Lifecycle.DRAINING
    assert state.reason == "completed 2 steps" and state.step == 2


def test_a_reload_moves_the_step_limit_checked_at_the_next_boundary() -> None:
    state = advance(initial_state(1, max_steps=2), Bootstrapped(0)).state
    state = advance(state, StepsChanged(1)).state
    assert state.max_steps == 1 and state.lifecycle is Lifecycle.RUNNING
    for _ in range(4):  # sync, barrier, resume, rollout
        state = finish_phase(state)
    assert state.step == 1  # step 1 started before the limit could be checked
    for _ in range(6):  # train .. rollout of step 1
        assert state.lifecycle is Lifecycle.RUNNING
        state = finish_phase(state)
    assert state.lifecycle is Lifecycle.DRAINING and state.reason == "completed 1 steps"
    with pytest.raises(InvalidTransition, match="at least one step"):
        advance(state, StepsChanged(0))


def test_a_job_paused_at_its_new_limit_drains_on_resume() -> None:
    state = advance(initial_state(1, max_steps=5), Bootstrapped(3)).state
    state = advance(state, Requested(Request.PAUSE)).state
    for _ in range(4):  # sync, barrier, resume, rollout; then the release is verified
        state = finish_phase(state)
    assert state.lifecycle is Lifecycle.PAUSED and state.step == 3
    state = advance(state, StepsChanged(3)).state
    outcome = advance(state, Requested(Request.RESUME))
    assert outcome.state.lifecycle is Lifecycle.DRAINING and outcome.start == ()


def test_requests_during_start_up() -> None:
    paused_later = run(initial_state(1), Requested(Request.PAUSE), Bootstrapped(step=0))
    assert paused_later.lifecycle is Lifecycle.RUNNING and Request.PAUSE in paused_later.requests
    drained = run(initial_state(1), Requested(Request.DRAIN), Bootstrapped(step=0))
    assert drained.lifecycle is Lifecycle.DRAINING


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (RankFinished(2, Phase.SYNC), "the job has ranks 0..1"),
        (RankFinished(0, Phase.TRAIN), "rank 0 is in sync"),
        (Bootstrapped(step=1), "not allowed"),
    ],
)
def test_bad_events_name_state_and_event(event: Event, message: str) -> None:
    state = run(initial_state(2), Bootstrapped(step=0))
    with pytest.raises(InvalidTransition, match=message):
        advance(state, event)


def test_a_rank_cannot_finish_twice() -> None:
    state = run(initial_state(2), Bootstrapped(step=0), RankFinished(0, Phase.SYNC))
    state = finish(state, 0)
    with pytest.raises(InvalidTransition, match=r"rank 0 is in barrier \(done\)"):
        advance(state, RankFinished(0, Phase.BARRIER))


def test_initial_state_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        initial_state(0)
    with pytest.raises(ValueError, match="subset"):
        initial_state(1, fences=frozenset({Phase.BARRIER}))


class RandomEvents(RuleBasedStateMachine):
    """Random events, legal or not: the job never reaches a state the rules do not declare."""

    def __init__(self) -> None:
        super().__init__()
        self.state = initial_state(3, max_steps=4)
        self.steps_seen = [0]
        self.largest_limit = 4

    def apply(self, event: Event) -> None:
        before = self.state
        try:
            outcome = advance(self.state, event)
        except InvalidTransition as exc:
            assert exc.state is before and exc.event is event
            assert before.lifecycle.value in str(exc) and type(event).__name__ in str(exc)
            # A pair the table lacks is "not allowed"; a legal pair refused says which rule.
            in_table = (before.lifecycle, type(event)) in TABLE
            assert str(exc).endswith(": not allowed") is not in_table, str(exc)
            return
        allowed = TABLE[(before.lifecycle, type(event))]
        assert outcome.state.lifecycle in allowed
        for rank, phase in outcome.start:
            assert outcome.state.ranks[rank] == replace(outcome.state.ranks[rank], phase=phase)
            assert not outcome.state.ranks[rank].done
        self.state = outcome.state
        self.steps_seen.append(self.state.step)

    @rule(step=st.integers(0, 3))
    def bootstrap(self, step: int) -> None:
        self.apply(Bootstrapped(step))

    @rule(rank=st.integers(0, 3), phase=st.sampled_from(Phase))
    def finish_any(self, rank: int, phase: Phase) -> None:
        self.apply(RankFinished(rank, phase))

    @rule(rank=st.integers(0, 2))
    def finish_current(self, rank: int) -> None:
        self.apply(RankFinished(rank, self.state.ranks[rank].phase))

    @rule(request=st.sampled_from(Request))
    def request(self, request: Request) -> None:
        self.apply(Requested(request))

    @rule(max_steps=st.integers(0, 6))
    def steps_changed(self, max_steps: int) -> None:
        self.apply(StepsChanged(max_steps))
        self.largest_limit = max(self.largest_limit, max_steps)

    @rule(rank=st.integers(0, 3), held=st.sampled_from([0.0, 0.0, 0.0, 64.0]))
    def barrier_checked(self, rank: int, held: float) -> None:
        self.apply(BarrierChecked(rank, held))

    @rule(held=st.sampled_from([0.0, 0.0, 0.0, 512.0]))
    def pause_checked(self, held: float) -> None:
        self.apply(PauseChecked((*released(3), Held("rollout", 2, held))))

    @rule()
    def drained(self) -> None:
        self.apply(Drained())

    @rule()
    def failed(self) -> None:
        if self.state.lifecycle is Lifecycle.RUNNING and self.state.step >= 3:
            self.apply(Failed("late failure"))

    @invariant()
    def fences_hold(self) -> None:
        if self.state.lifecycle is Lifecycle.RUNNING:
            assert len({SEGMENT[p] for p in self.state.phases}) == 1, self.state

    @invariant()
    def steps_never_go_back_while_running(self) -> None:
        if self.state.lifecycle is not Lifecycle.STARTING:
            assert self.steps_seen[-1] >= max(self.steps_seen[1:], default=0)

    @invariant()
    def steps_are_bounded(self) -> None:
        assert self.state.max_steps is not None
        # bootstrap may start at step 3; a lowered limit stops the job at the next boundary
        assert self.state.step <= self.largest_limit + 3

    @invariant()
    def a_failure_says_why(self) -> None:
        if self.state.lifecycle is Lifecycle.FAILED:
            assert self.state.reason

    @invariant()
    def stopped_only_when_idle(self) -> None:
        if self.state.lifecycle is Lifecycle.STOPPED:
            assert self.state.idle

    @invariant()
    def meeting_only_at_barrier_while_running(self) -> None:
        for progress in self.state.ranks:
            if progress.meeting:
                assert progress.phase is Phase.BARRIER and not progress.done
                assert self.state.lifecycle in (Lifecycle.RUNNING, Lifecycle.FAILED)

    @invariant()
    def declared(self) -> None:
        assert isinstance(self.state.lifecycle, Lifecycle)
        assert all(isinstance(p, Phase) for p in self.state.phases)
        assert self.state.requests <= set(Request) - {Request.RESUME, Request.STOP}


TestRandomEvents = RandomEvents.TestCase
TestRandomEvents.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


# -- failures, memory rules and drains -----------------------------------------------------------


def test_a_failure_the_driver_saw_fails_the_job_naming_where() -> None:
    state = run(initial_state(2), Bootstrapped(step=0))
    blame = Blame(1, "rollout", "sync")
    failed = run(state, Failed("rollout rank 1 died", blame))
    assert failed.lifecycle is Lifecycle.FAILED
    assert (failed.reason, failed.blame) == ("rollout rank 1 died", blame)
    with pytest.raises(InvalidTransition, match="not allowed"):
        advance(failed, Requested(Request.RESUME))  # nothing moves a failed job


def test_memory_held_at_barrier_fails_the_job_naming_the_trainer() -> None:
    state = finish_phase(run(initial_state(2), Bootstrapped(step=0)))  # both in barrier
    outcome = advance(state, BarrierChecked(1, held_mb=12.5))
    assert outcome.state.lifecycle is Lifecycle.FAILED and outcome.meet == ()
    assert outcome.state.blame == Blame(1, "trainer", "barrier")
    assert "trainer still holds 12.5 MiB of device memory at BARRIER" in str(outcome.state.reason)


def test_a_released_rank_meets_the_others_at_the_store_barrier() -> None:
    state = finish_phase(run(initial_state(2), Bootstrapped(step=0)))
    with pytest.raises(InvalidTransition, match="not passed its BARRIER memory check"):
        advance(state, RankFinished(0, Phase.BARRIER))
    outcome = advance(state, BarrierChecked(0, held_mb=0.0))
    assert outcome.meet == (0,) and outcome.start == ()
    assert outcome.state.ranks[0].meeting and not outcome.state.idle
    with pytest.raises(InvalidTransition, match="already checked"):
        advance(outcome.state, BarrierChecked(0, held_mb=0.0))
    met = advance(outcome.state, RankFinished(0, Phase.BARRIER))
    assert met.state.ranks[0].done and met.start == ()  # RESUME is fenced: rank 1 is awaited


def test_without_the_resume_fence_nobody_meets_at_the_store_barrier() -> None:
    state = run(initial_state(2, fences=MEMORY_FENCES - {Phase.RESUME}), Bootstrapped(step=0))
    state = finish_phase(state)
    outcome = advance(state, BarrierChecked(0, held_mb=0.0))
    assert outcome.meet == () and outcome.start == ((0, Phase.RESUME),)


def pausing(ranks: int = 2) -> JobState:
    """A job whose every rank stands at the cycle boundary, a pause pending its release check."""
    state = run(initial_state(ranks), Bootstrapped(step=0), Requested(Request.PAUSE))
    for _ in range(3):
        state = finish_phase(state)
    for rank in range(ranks):
        state = finish(state, rank)  # rollout ends
    return state


def test_a_pause_is_checked_before_it_counts_as_paused() -> None:
    state = run(initial_state(2), Bootstrapped(step=0), Requested(Request.PAUSE))
    for _ in range(3):
        state = finish_phase(state)
    last = advance(finish(state, 0), RankFinished(1, Phase.ROLLOUT))
    assert last.check_release and last.start == ()
    assert last.state.lifecycle is Lifecycle.RUNNING and not last.state.idle
    paused = advance(last.state, PauseChecked(released(2)))
    assert paused.state.lifecycle is Lifecycle.PAUSED and paused.state.idle


def test_a_pause_that_released_nothing_fails_naming_the_worker() -> None:
    held = (Held("trainer", 0, 0.0), Held("rollout", 1, 512.0), Held("trainer", 1, 64.0))
    outcome = advance(pausing(), PauseChecked(held))
    assert outcome.state.lifecycle is Lifecycle.FAILED
    assert outcome.state.blame == Blame(1, "rollout", "pause")
    assert outcome.state.reason == (
        "paused, but device memory is still held (MiB): rollout rank 1: 512, trainer rank 1: 64"
    )


def test_a_resume_during_the_release_check_goes_on_after_it() -> None:
    state = run(pausing(), Requested(Request.RESUME))
    assert state.checking_release  # the check in flight still answers
    outcome = advance(state, PauseChecked(released(2)))
    assert outcome.state.lifecycle is Lifecycle.RUNNING
    assert outcome.start == ((0, Phase.TRAIN), (1, Phase.TRAIN))


def test_a_drain_during_the_release_check_drains_once_it_answered() -> None:
    state = run(pausing(), Requested(Request.DRAIN))
    assert state.lifecycle is Lifecycle.RUNNING and state.checking_release
    outcome = advance(state, PauseChecked(released(2)))
    assert outcome.state.lifecycle is Lifecycle.DRAINING and outcome.start == ()
    assert outcome.state.reason == "drain requested" and outcome.state.idle


def test_a_stop_during_the_release_check_drains_once_it_answered() -> None:
    state = run(pausing(), Requested(Request.STOP))
    assert state.lifecycle is Lifecycle.DRAINING and not state.idle
    with pytest.raises(InvalidTransition, match="work is still in flight"):
        advance(state, Drained())
    checked = run(state, PauseChecked(released(2)))
    assert checked.idle and run(checked, Drained()).lifecycle is Lifecycle.STOPPED


def test_a_drain_ends_when_the_last_phase_in_flight_ends() -> None:
    state = run(initial_state(3), Bootstrapped(step=0), Requested(Request.STOP))
    assert not state.idle
    for rank in (2, 0):
        state = run(state, RankFinished(rank, Phase.SYNC))
        assert not state.idle
    state = run(state, RankFinished(1, Phase.SYNC))
    assert state.idle and run(state, Drained()).lifecycle is Lifecycle.STOPPED


def test_a_drain_releases_ranks_waiting_at_the_store_barrier() -> None:
    state = finish_phase(run(initial_state(2), Bootstrapped(step=0)))
    state = run(state, BarrierChecked(0, held_mb=0.0))  # rank 0 meets, rank 1 works on
    state = run(state, Requested(Request.STOP))
    assert state.ranks[0].done and not state.ranks[0].meeting  # no RESUME follows: stop waiting
    outcome = advance(state, BarrierChecked(1, held_mb=0.0))
    assert outcome.meet == () and outcome.state.idle  # draining: nobody meets any more


def test_a_drain_during_start_up_has_nothing_in_flight() -> None:
    state = run(initial_state(2), Requested(Request.DRAIN), Bootstrapped(step=4))
    assert state.lifecycle is Lifecycle.DRAINING and state.idle and state.step == 4
