"""What the driver performs after each move: `plan` over real transitions of the machine."""

from __future__ import annotations

from timeshare.state import (
    BarrierChecked,
    Bootstrapped,
    Drained,
    Failed,
    Lifecycle,
    Phase,
    RankFinished,
    Request,
    Requested,
    advance,
    initial_state,
    plan,
)


def test_bootstrap_starts_every_rank_and_publishes() -> None:
    before = initial_state(2)
    steps = plan(before, advance(before, Bootstrapped(step=3)))
    assert steps.start == ((0, Phase.SYNC), (1, Phase.SYNC))
    assert steps.publish and not steps.ended and not steps.finish_drain


def test_a_rank_moving_on_alone_is_not_published() -> None:
    before = advance(initial_state(2), Bootstrapped(step=0)).state
    steps = plan(before, advance(before, RankFinished(1, Phase.SYNC)))
    assert steps.start == ((1, Phase.BARRIER),) and not steps.publish


def test_a_checked_barrier_meets_the_others() -> None:
    state = advance(initial_state(2), Bootstrapped(step=0)).state
    state = advance(state, RankFinished(0, Phase.SYNC)).state
    steps = plan(state, advance(state, BarrierChecked(0, held_mb=0.0)))
    assert steps.meet == (0,) and steps.start == () and not steps.publish


def test_a_stop_with_work_in_flight_waits_then_finishes_the_drain() -> None:
    running = advance(initial_state(1), Bootstrapped(step=0)).state
    stop = advance(running, Requested(Request.STOP))
    steps = plan(running, stop)
    assert steps.cancel_meets and steps.publish and not steps.finish_drain
    last = advance(stop.state, RankFinished(0, Phase.SYNC))
    assert plan(stop.state, last).finish_drain and not plan(stop.state, last).cancel_meets
    stopped = advance(last.state, Drained())
    assert plan(last.state, stopped).ended and stopped.state.lifecycle is Lifecycle.STOPPED


def test_a_failure_ends_the_run() -> None:
    running = advance(initial_state(1), Bootstrapped(step=0)).state
    steps = plan(running, advance(running, Failed("boom")))
    assert steps.ended and steps.publish and steps.start == ()
