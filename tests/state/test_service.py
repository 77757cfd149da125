"""The service's lifecycle table and how it answers requests, pair by pair."""

from __future__ import annotations

import pytest

from timeshare.errors import InvalidTransition, NotRunning
from timeshare.state import Lifecycle, Request
from timeshare.state.service import (
    FINAL,
    REQUESTS,
    SHOWN,
    TABLE,
    Answer,
    CycleEnded,
    CycleWanted,
    JobMoved,
    ServiceEvent,
    ServiceLifecycle,
    StopRequested,
    advance_service,
    answer,
    waited,
)

S = ServiceLifecycle
EVENTS: list[ServiceEvent] = [
    CycleWanted(),
    *(JobMoved(lifecycle) for lifecycle in Lifecycle),
    CycleEnded(),
    CycleEnded(failed=True),
    StopRequested(),
]


@pytest.mark.parametrize("state", list(S), ids=lambda s: s.value)
def test_every_pair_is_legal_exactly_when_the_table_says(state: ServiceLifecycle) -> None:
    for event in EVENTS:
        allowed = TABLE.get((state, type(event)))
        if allowed is None:
            with pytest.raises(InvalidTransition, match=f"{type(event).__name__} in {state.value}"):
                advance_service(state, event)
            continue
        following = SHOWN[event.lifecycle] if isinstance(event, JobMoved) else None
        if following is not None and state not in FINAL and following not in allowed:
            with pytest.raises(InvalidTransition, match=f"cannot lead to {following.value}"):
                advance_service(state, event)  # e.g. a running job never starts again
            continue
        assert advance_service(state, event) in allowed


def test_the_service_follows_its_job_and_goes_idle_when_the_cycle_ends() -> None:
    state = S.STARTING
    for job, shown in [
        (Lifecycle.RUNNING, S.RUNNING),
        (Lifecycle.PAUSED, S.PAUSED),
        (Lifecycle.RUNNING, S.RUNNING),
        (Lifecycle.DRAINING, S.DRAINING),
        (Lifecycle.STOPPED, S.DRAINING),  # workers shutting down
    ]:
        state = advance_service(state, JobMoved(job))
        assert state is shown
    state = advance_service(state, CycleEnded())
    assert state is S.IDLE
    assert advance_service(state, CycleWanted()) is S.STARTING


def test_stopping_and_failed_are_final() -> None:
    for job in Lifecycle:
        if SHOWN[job] is not S.FAILED:
            assert advance_service(S.STOPPING, JobMoved(job)) is S.STOPPING
    assert advance_service(S.STOPPING, CycleEnded()) is S.STOPPING
    assert advance_service(S.STOPPING, JobMoved(Lifecycle.FAILED)) is S.FAILED
    assert advance_service(S.FAILED, StopRequested()) is S.FAILED
    assert advance_service(S.RUNNING, CycleEnded(failed=True)) is S.FAILED
    assert {S.STOPPING, S.FAILED} == FINAL
    for final in FINAL:
        with pytest.raises(InvalidTransition):
            advance_service(final, CycleWanted())


def test_every_request_has_an_answer_in_every_state() -> None:
    for request in Request:
        assert set(REQUESTS[request]) == set(S)


@pytest.mark.parametrize(
    ("asked", "state", "expected"),
    [
        (Request.PAUSE, S.RUNNING, Answer.FORWARD),
        (Request.PAUSE, S.PAUSED, Answer.FORWARD),  # a resume may be on its way
        (Request.RESUME, S.PAUSED, Answer.FORWARD),
        (Request.RESUME, S.IDLE, Answer.START_CYCLE),
        (Request.DRAIN, S.IDLE, Answer.NOTHING),
        (Request.DRAIN, S.STARTING, Answer.FORWARD),
        (Request.STOP, S.DRAINING, Answer.FORWARD),
        (Request.STOP, S.IDLE, Answer.NOTHING),
        (Request.STOP, S.STOPPING, Answer.NOTHING),
    ],
)
def test_requests_that_are_taken(asked: Request, state: ServiceLifecycle, expected: Answer) -> None:
    assert answer(asked, state, steps_left=True) is expected


@pytest.mark.parametrize(
    ("asked", "state", "error", "message"),
    [
        (Request.PAUSE, S.IDLE, NotRunning, "pause: no cycle is running (idle)"),
        (Request.PAUSE, S.STOPPING, InvalidTransition, "pause is not possible while stopping"),
        (Request.RESUME, S.DRAINING, InvalidTransition, "resume is not possible while draining"),
        (Request.RESUME, S.FAILED, NotRunning, "resume: no cycle is running (failed)"),
        (Request.DRAIN, S.FAILED, NotRunning, "drain: no cycle is running (failed)"),
    ],
)
def test_requests_that_are_refused_name_the_request_and_state(
    asked: Request, state: ServiceLifecycle, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        answer(asked, state, steps_left=True)
    assert str(info.value) == message


def test_a_resume_with_no_steps_left_is_refused_saying_what_to_do() -> None:
    with pytest.raises(NotRunning, match=r"raise job\.steps and reload"):
        answer(Request.RESUME, S.IDLE, steps_left=False)


def test_waits_end_at_their_target_or_when_it_cannot_come() -> None:
    assert waited(Request.PAUSE, S.PAUSED) and not waited(Request.PAUSE, S.RUNNING)
    assert waited(Request.DRAIN, S.IDLE) and not waited(Request.DRAIN, S.DRAINING)
    for state in (S.IDLE, S.STOPPING, S.FAILED):
        with pytest.raises(NotRunning, match=f"pause: the cycle ended \\({state.value}\\)"):
            waited(Request.PAUSE, state)
    with pytest.raises(NotRunning):
        waited(Request.DRAIN, S.FAILED)
