"""The machine of one node of several: it waits for the other nodes at every fence, decides
only once they came, and so does every node with the same requests (`applies_at_once`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.state.test_machine import finish, run
from timeshare.state import (
    BarrierChecked,
    Bootstrapped,
    Crossed,
    Drained,
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
    applies_at_once,
    initial_state,
)
from timeshare.state.events import Held


def node(first_rank: int = 2) -> JobState:
    """Node 1 of two, ranks 2 and 3, in SYNC of its first step."""
    return run(initial_state(2, nodes=2, first_rank=first_rank), Bootstrapped(step=0))


def at_fence(state: JobState) -> JobState:
    """Every rank of the node finishes its phase; the node then waits for the others."""
    for rank in range(len(state.ranks)):
        state = finish(state, rank)
    return state


def test_the_last_rank_at_a_fence_waits_for_the_other_nodes_and_starts_nothing() -> None:
    outcome = advance(node(), RankFinished(0, Phase.SYNC))  # SYNC -> BARRIER is no fence
    assert outcome.start == ((0, Phase.BARRIER),) and outcome.cross is None
    state = at_fence(at_fence(node()))  # SYNC, then BARRIER (met): RESUME is fenced
    assert state.crossing is Phase.RESUME and not state.idle
    assert all(r.done and r.phase is Phase.BARRIER for r in state.ranks)
    outcome = advance(state, Crossed(Phase.RESUME))
    assert outcome.start == ((0, Phase.RESUME), (1, Phase.RESUME))
    assert outcome.state.crossing is None


def test_the_fence_that_asks_for_a_crossing_says_so() -> None:
    state = finish(at_fence(node()), 0)  # in BARRIER: rank 1 is the last to come
    state = advance(state, BarrierChecked(1, 0.0)).state
    outcome = advance(state, RankFinished(1, Phase.BARRIER))
    assert outcome.cross is Phase.RESUME and outcome.start == ()


def test_a_crossing_of_another_fence_or_of_none_is_refused() -> None:
    with pytest.raises(InvalidTransition, match="waits at no fence"):
        advance(node(), Crossed(Phase.RESUME))
    waiting = at_fence(at_fence(node()))
    with pytest.raises(InvalidTransition, match="waits at the fence before resume"):
        advance(waiting, Crossed(Phase.TRAIN))


def test_requests_held_to_the_crossing_decide_there_the_same_on_every_node() -> None:
    """Both nodes get the pause before the crossing before TRAIN: both check, both pause."""
    state = node()
    while state.crossing is not Phase.TRAIN:
        state = at_fence(state)
        if state.crossing is not None and state.crossing is not Phase.TRAIN:
            state = advance(state, Crossed(state.crossing)).state
    state = advance(state, Requested(Request.PAUSE)).state
    outcome = advance(state, Crossed(Phase.TRAIN))
    assert outcome.check_release and outcome.start == ()
    held = tuple(Held(role, r, 0.0) for r in (2, 3) for role in ("trainer", "rollout"))
    assert advance(outcome.state, PauseChecked(held)).state.lifecycle is Lifecycle.PAUSED


def test_a_stop_ends_the_wait_for_the_other_nodes() -> None:
    waiting = at_fence(at_fence(node()))
    draining = advance(waiting, Requested(Request.STOP)).state
    assert draining.lifecycle is Lifecycle.DRAINING and draining.crossing is None
    assert draining.idle
    assert advance(draining, Drained()).state.lifecycle is Lifecycle.STOPPED


def test_a_node_names_its_ranks_by_their_job_numbers() -> None:
    state = at_fence(node(first_rank=2))
    outcome = advance(state, BarrierChecked(1, 7.0))
    assert outcome.state.lifecycle is Lifecycle.FAILED
    assert outcome.state.reason is not None and "trainer rank 3" in outcome.state.reason
    assert outcome.state.blame is not None and outcome.state.blame.rank == 3


def test_one_node_never_waits_for_others() -> None:
    state = run(initial_state(2), Bootstrapped(step=0))
    state = at_fence(at_fence(state))
    assert state.crossing is None
    assert {r.phase for r in state.ranks} == {Phase.RESUME}


@pytest.mark.parametrize(
    ("nodes", "lifecycle", "asked", "at_once"),
    [
        (1, Lifecycle.RUNNING, Request.PAUSE, True),
        (1, Lifecycle.STARTING, Request.DRAIN, True),
        (2, Lifecycle.RUNNING, Request.PAUSE, False),
        (2, Lifecycle.RUNNING, Request.DRAIN, False),
        (2, Lifecycle.STARTING, Request.DRAIN, False),
        (2, Lifecycle.RUNNING, Request.STOP, False),
        (2, Lifecycle.STARTING, Request.STOP, False),
        (2, Lifecycle.PAUSED, Request.STOP, True),
        (2, Lifecycle.PAUSED, Request.RESUME, True),
        (2, Lifecycle.PAUSED, Request.DRAIN, True),
    ],
)
def test_which_commands_reach_a_node_at_once(
    nodes: int, lifecycle: Lifecycle, asked: Request, at_once: bool
) -> None:
    state = replace(initial_state(2, nodes=nodes), lifecycle=lifecycle)
    assert applies_at_once(state, Requested(asked)) is at_once


def test_a_new_step_limit_waits_for_the_crossing_on_several_nodes() -> None:
    assert not applies_at_once(node(), StepsChanged(9))
    assert applies_at_once(run(initial_state(2), Bootstrapped(step=0)), StepsChanged(9))
