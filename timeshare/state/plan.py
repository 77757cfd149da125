"""What the driver does after each transition: the machine's outcome turned into actions.

Pure, like the machine: `plan(before, outcome)` looks at the move the job just made and says
what to perform, in this order: stop waiting at the node's meeting if a drain began; start the
phases; meet the others at the node's meeting; wait for the other nodes at a fence; check every
worker's release at a pause; finish a drain that has nothing in flight; publish the job's state
to the store; end the run. The driver (timeshare/cycle) performs it and feeds what happened back
as events.
"""

from __future__ import annotations

from dataclasses import dataclass

from timeshare.state.events import Lifecycle, Phase
from timeshare.state.job import JobState
from timeshare.state.machine import Outcome

ENDED = (Lifecycle.STOPPED, Lifecycle.FAILED)


@dataclass(frozen=True)
class Plan:
    start: tuple[tuple[int, Phase], ...] = ()  # (rank, phase) to run, in rank order
    meet: tuple[int, ...] = ()  # ranks that now wait for every rank at the node's meeting
    cross: Phase | None = None  # wait for every other node at the fence before this phase
    cancel_meets: bool = False  # a drain began: nobody waits at the node's meeting any more, nor
    # for the other nodes at a fence
    check_release: bool = False  # ask every worker what it holds; answer with PauseChecked
    finish_drain: bool = False  # draining and nothing in flight: answer with Drained
    publish: bool = False  # a job-wide move: every node and operator should see it
    ended: bool = False  # STOPPED or FAILED: the run is over


def plan(before: JobState, outcome: Outcome) -> Plan:
    after = outcome.state
    moved = after.lifecycle is not before.lifecycle
    draining = after.lifecycle is Lifecycle.DRAINING
    return Plan(
        start=outcome.start,
        meet=outcome.meet,
        cross=outcome.cross,
        cancel_meets=draining and moved,
        check_release=outcome.check_release,
        finish_drain=draining and after.idle,
        # Job-wide moves only (a fence passed, the lifecycle changed): a store write per rank
        # and phase would put a round trip on every phase's path.
        publish=moved or (len(outcome.start) == len(after.ranks)),
        ended=after.lifecycle in ENDED,
    )
