"""The service's lifecycle: what `timeshared` is doing, and what an operator may ask of it.

Rules (the tables below are the truth; this comment explains them):

- The service is STARTING (a cycle is wanted: workers spawn, the checkpoint loads), then follows
  its job's machine: RUNNING, PAUSED, DRAINING (also while a stopped cycle shuts its workers
  down). When the cycle returns the service is IDLE: it stays up and answers until stopped, and
  `resume` starts the remaining steps. Started by socket activation, it begins IDLE: a status
  query must never start training.
- `stop` (or SIGTERM) makes it STOPPING at once, whatever the job does: the cycle drains and the
  daemon exits. A failed cycle makes it FAILED; the daemon exits 1 so that systemd restarts it.
  Both are final: nothing moves the service out of them.
- An operator's request is answered from REQUESTS: forwarded to the job (written to the job
  store, applied by every node at a safe point), a no-op when it is already so, a new cycle
  (`resume` while IDLE, if steps remain), or refused: `NotRunning` when no cycle runs to take
  it, `InvalidTransition` when the service's state does not allow it.
- `pause --wait` waits for PAUSED and `drain --wait` for IDLE; a wait ends with `NotRunning` if
  the service reaches a state from which that can no longer happen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

from timeshare.errors import InvalidTransition, NotRunning
from timeshare.state.events import Lifecycle, Request


class ServiceLifecycle(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    IDLE = "idle"
    STOPPING = "stopping"
    FAILED = "failed"


S = ServiceLifecycle
CYCLE_STATES = (S.STARTING, S.RUNNING, S.PAUSED, S.DRAINING)  # a cycle is wanted, or runs
FINAL = frozenset({S.STOPPING, S.FAILED})  # the daemon exits once its cycle has ended
# States in which the cycle must keep making transitions: the watchdog's test.
MOVING = frozenset({S.STARTING, S.RUNNING, S.DRAINING, S.STOPPING})
# What the service shows for each state of its job's machine.
SHOWN: dict[Lifecycle, ServiceLifecycle] = {
    Lifecycle.STARTING: S.STARTING,
    Lifecycle.RUNNING: S.RUNNING,
    Lifecycle.PAUSED: S.PAUSED,
    Lifecycle.DRAINING: S.DRAINING,
    Lifecycle.STOPPED: S.DRAINING,  # the cycle shuts its workers down; then IDLE
    Lifecycle.FAILED: S.FAILED,
}


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CycleWanted:
    """`resume` while IDLE with steps left: a new cycle starts."""


@dataclass(frozen=True)
class JobMoved:
    """The job's machine reached `lifecycle`."""

    lifecycle: Lifecycle


@dataclass(frozen=True)
class CycleEnded:
    """The cycle returned: its steps are done, it drained, or (`failed`) it failed."""

    failed: bool = False


@dataclass(frozen=True)
class StopRequested:
    """`stop` or SIGTERM: drain and exit."""


ServiceEvent: TypeAlias = CycleWanted | JobMoved | CycleEnded | StopRequested

# (state, event type) -> the states it may lead to. A pair missing here is illegal.
TABLE: dict[tuple[ServiceLifecycle, type], frozenset[ServiceLifecycle]] = {
    (S.IDLE, CycleWanted): frozenset({S.STARTING}),
    (S.STARTING, JobMoved): frozenset({S.STARTING, S.RUNNING, S.DRAINING, S.FAILED}),
    **{
        (state, JobMoved): frozenset({S.RUNNING, S.PAUSED, S.DRAINING, S.FAILED})
        for state in (S.RUNNING, S.PAUSED, S.DRAINING)
    },
    (S.STOPPING, JobMoved): frozenset({S.STOPPING, S.FAILED}),
    **{(state, CycleEnded): frozenset({S.IDLE, S.FAILED}) for state in CYCLE_STATES},
    (S.STOPPING, CycleEnded): frozenset({S.STOPPING, S.FAILED}),
    (S.FAILED, CycleEnded): frozenset({S.FAILED}),
    **{(state, StopRequested): frozenset({S.STOPPING}) for state in S if state is not S.FAILED},
    (S.FAILED, StopRequested): frozenset({S.FAILED}),
}


def advance_service(state: ServiceLifecycle, event: ServiceEvent) -> ServiceLifecycle:
    """The service's state after `event`; `InvalidTransition` (nothing changed) if illegal."""
    allowed = TABLE.get((state, type(event)))
    if allowed is None:
        raise InvalidTransition(
            f"{type(event).__name__} in {state.value}: not allowed", state=state, event=event
        )
    following = _apply(state, event)
    if following not in allowed:  # a job move the service cannot follow from here
        raise InvalidTransition(
            f"{type(event).__name__} in {state.value}: cannot lead to {following.value}",
            state=state,
            event=event,
        )
    return following


def _apply(state: ServiceLifecycle, event: ServiceEvent) -> ServiceLifecycle:
    if isinstance(event, CycleWanted):
        return S.STARTING
    if isinstance(event, StopRequested):
        return S.FAILED if state is S.FAILED else S.STOPPING
    if isinstance(event, CycleEnded):
        if event.failed:
            return S.FAILED
        return state if state in FINAL else S.IDLE
    shown = SHOWN[event.lifecycle]
    if state is S.STOPPING and shown is not S.FAILED:
        return S.STOPPING
    return shown


# -- operator requests -----------------------------------------------------------------------


class Answer(enum.Enum):
    FORWARD = "forward"  # write the request to the job store: the job takes it at a safe point
    NOTHING = "nothing"  # it is already so (or will be): repeating a request is harmless
    START_CYCLE = "start cycle"  # resume while IDLE: run the remaining steps
    NOT_RUNNING = "not running"  # no cycle runs that could take it
    REFUSED = "refused"  # the service's state does not allow it


_FORWARD_IN_CYCLE = {state: Answer.FORWARD for state in CYCLE_STATES}
REQUESTS: dict[Request, dict[ServiceLifecycle, Answer]] = {
    Request.PAUSE: {
        # Also while PAUSED: a resume forwarded a moment ago may not have been applied yet.
        **_FORWARD_IN_CYCLE,
        S.DRAINING: Answer.REFUSED,
        S.IDLE: Answer.NOT_RUNNING,
        S.STOPPING: Answer.REFUSED,
        S.FAILED: Answer.NOT_RUNNING,
    },
    Request.RESUME: {
        **_FORWARD_IN_CYCLE,
        S.DRAINING: Answer.REFUSED,
        S.IDLE: Answer.START_CYCLE,
        S.STOPPING: Answer.REFUSED,
        S.FAILED: Answer.NOT_RUNNING,
    },
    Request.DRAIN: {
        **_FORWARD_IN_CYCLE,
        S.DRAINING: Answer.NOTHING,
        S.IDLE: Answer.NOTHING,
        S.STOPPING: Answer.NOTHING,  # the exit drains anyway
        S.FAILED: Answer.NOT_RUNNING,
    },
    Request.STOP: {
        **_FORWARD_IN_CYCLE,
        S.IDLE: Answer.NOTHING,  # no cycle to tell; the service itself stops
        S.STOPPING: Answer.NOTHING,
        S.FAILED: Answer.NOTHING,
    },
}


def answer(request: Request, state: ServiceLifecycle, *, steps_left: bool) -> Answer:
    """How the service takes `request` in `state`; a refusal is raised, naming both."""
    verdict = REQUESTS[request][state]
    if verdict is Answer.START_CYCLE and not steps_left:
        raise NotRunning("resume: every step of the job is done; raise job.steps and reload")
    if verdict is Answer.NOT_RUNNING:
        raise NotRunning(f"{request.value}: no cycle is running ({state.value})")
    if verdict is Answer.REFUSED:
        raise InvalidTransition(
            f"{request.value} is not possible while {state.value}", state=state, event=request
        )
    return verdict


# What `--wait` waits for, and the states from which it can no longer come.
WAIT_FOR: dict[Request, ServiceLifecycle] = {Request.PAUSE: S.PAUSED, Request.DRAIN: S.IDLE}
WAIT_ENDS: dict[Request, frozenset[ServiceLifecycle]] = {
    Request.PAUSE: frozenset({S.IDLE, S.STOPPING, S.FAILED}),
    Request.DRAIN: frozenset({S.STOPPING, S.FAILED}),
}


def waited(request: Request, state: ServiceLifecycle) -> bool:
    """Whether a `--wait` for `request` is over in `state`; `NotRunning` if it never will be."""
    if state is WAIT_FOR[request]:
        return True
    if state in WAIT_ENDS[request]:
        raise NotRunning(f"{request.value}: the cycle ended ({state.value})")
    return False
