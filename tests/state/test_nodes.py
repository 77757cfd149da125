"""The machine of one node of several: it waits for the other nodes at every fence, decides
only once they came, and so does every node with the same requests (`applies_at_once`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.state.test_machine import finish, run
from timeshare.state import (
    BarrierChecked,
    Bootstrapped,
    Commanded,
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
    state = advance(crossing_before_train(), Requested(Request.PAUSE)).state
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
    ("nodes", "lifecycle", "at_once"),
    [
        (1, Lifecycle.STARTING, True),
        (1, Lifecycle.RUNNING, True),
        (2, Lifecycle.STARTING, False),
        (2, Lifecycle.RUNNING, False),
        (2, Lifecycle.DRAINING, False),
        (2, Lifecycle.PAUSED, True),
    ],
)
def test_when_commands_reach_a_node_at_once(
    nodes: int, lifecycle: Lifecycle, at_once: bool
) -> None:
    assert applies_at_once(replace(initial_state(2, nodes=nodes), lifecycle=lifecycle)) is at_once


def crossing_before_train() -> JobState:
    """Node 1 of two, every rank done with ROLLOUT of step 0: waiting to cross before TRAIN."""
    state = node()
    while state.crossing is not Phase.TRAIN:
        state = at_fence(state)
        if state.crossing is not None and state.crossing is not Phase.TRAIN:
            state = advance(state, Crossed(state.crossing)).state
    return state


def test_on_several_nodes_a_command_waits_for_the_crossing_even_a_stop() -> None:
    state = advance(node(), Commanded(1, Requested(Request.STOP))).state
    assert state.lifecycle is Lifecycle.RUNNING and state.held == (
        Commanded(1, Requested(Request.STOP)),
    )
    one = run(initial_state(2), Bootstrapped(step=0), Commanded(1, Requested(Request.STOP)))
    assert one.lifecycle is Lifecycle.DRAINING and one.held == ()


def test_a_crossing_applies_the_commands_up_to_the_newest_any_node_had_seen() -> None:
    state = crossing_before_train()
    state = run(state, Commanded(4, Requested(Request.PAUSE)), Commanded(5, StepsChanged(9)))
    outcome = advance(state, Crossed(Phase.TRAIN, through=4))
    assert outcome.check_release and outcome.start == ()  # the pause, at this fence
    assert outcome.state.held == (Commanded(5, StepsChanged(9)),)  # the next crossing's
    assert outcome.state.max_steps is None


def test_a_stop_released_at_a_crossing_drains_there_and_nothing_starts() -> None:
    state = run(crossing_before_train(), Commanded(2, Requested(Request.STOP)))
    outcome = advance(state, Crossed(Phase.TRAIN, through=2))
    assert outcome.state.lifecycle is Lifecycle.DRAINING and outcome.start == ()
    assert outcome.state.crossing is None and outcome.state.idle


def test_commands_held_when_the_pause_took_effect_apply_then() -> None:
    state = run(crossing_before_train(), Commanded(1, Requested(Request.PAUSE)))
    state = advance(state, Crossed(Phase.TRAIN, through=1)).state
    state = advance(state, Commanded(2, Requested(Request.RESUME))).state  # read after
    assert state.checking_release and state.held == (Commanded(2, Requested(Request.RESUME)),)
    held = tuple(Held(role, r, 0.0) for r in (2, 3) for role in ("trainer", "rollout"))
    outcome = advance(state, PauseChecked(held))
    assert outcome.state.lifecycle is Lifecycle.RUNNING and outcome.state.held == ()
    assert outcome.start == ((0, Phase.TRAIN), (1, Phase.TRAIN))


def test_a_held_command_the_job_cannot_take_is_refused_and_dropped() -> None:
    state = run(crossing_before_train(), Commanded(1, Requested(Request.STOP)))
    state = run(state, Commanded(2, Requested(Request.RESUME)))
    outcome = advance(state, Crossed(Phase.TRAIN, through=2))
    assert outcome.state.lifecycle is Lifecycle.DRAINING and outcome.state.held == ()
    assert len(outcome.refused) == 1 and "a draining job cannot resume" in outcome.refused[0]


def test_while_paused_a_command_applies_at_once() -> None:
    state = run(crossing_before_train(), Commanded(1, Requested(Request.PAUSE)))
    state = advance(state, Crossed(Phase.TRAIN, through=1)).state
    held = tuple(Held(role, r, 0.0) for r in (2, 3) for role in ("trainer", "rollout"))
    paused = advance(state, PauseChecked(held)).state
    assert paused.lifecycle is Lifecycle.PAUSED
    outcome = advance(paused, Commanded(2, Requested(Request.RESUME)))
    assert outcome.state.lifecycle is Lifecycle.RUNNING and outcome.start
