"""Performing what the plan says, one piece at a time: each returns what happened, or raises.

A phase is a command on both workers of a rank; the first failure cancels the other call (it
would only wait for a dead peer) and is raised as `CycleFailed` naming rank, role and phase.
(A call that passed its deadline or stalled was aborted by the lanes first: its worker's log
shows where it was stuck.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence

import anyio
import structlog

from timeshare.cluster import ranks_of_node
from timeshare.cycle.meeting import NodeMeeting
from timeshare.cycle.workers import Workers
from timeshare.errors import (
    CollectiveTimeout,
    CycleFailed,
    MemoryHeld,
    WorkerFailure,
)
from timeshare.protocols.commands import LaneCall, WorkerId
from timeshare.protocols.commands.params import PhaseParams
from timeshare.protocols.commands.results import (
    ROLES,
    BootstrapResult,
    CommandResult,
    HeldResult,
    result_type,
)
from timeshare.protocols.nodes import A, B, NodeCrossing
from timeshare.protocols.store import JobStore
from timeshare.state import Blame, Held, JobState, Phase

log = structlog.get_logger(__name__)


def cycle_failed(
    rank: int, role: str, phase: str, exc: BaseException, *, started: float | None = None
) -> CycleFailed:
    """The run's failure: where it happened, its typed cause, and how long into the phase."""
    failed = CycleFailed(
        f"{role} rank {rank} failed in phase {phase}: {type(exc).__name__}: {exc}",
        rank=rank,
        role=role,
        phase=phase,
        cause=exc,
        after_s=None if started is None else time.monotonic() - started,
    )
    failed.__cause__ = exc
    return failed


def node_failed(node: int, ranks: range, phase: str, exc: BaseException) -> CycleFailed:
    """The run's failure when a whole node is gone (its daemon, or the store it hosted)."""
    failed = CycleFailed(
        f"node {node} (ranks {ranks.start}-{ranks.stop - 1}) failed in phase {phase}: "
        f"{type(exc).__name__}: {exc}",
        rank=ranks.start,
        role="node",
        phase=phase,
        cause=exc,
    )
    failed.__cause__ = exc
    return failed


def blame_of(failed: CycleFailed) -> Blame:
    return Blame(failed.rank, failed.role, failed.phase)


def rule_broken(state: JobState) -> CycleFailed:
    """The failure the machine's memory rules found in a FAILED `state` (no task saw one)."""
    blame = state.blame
    assert blame is not None and state.reason is not None, state
    return cycle_failed(blame.rank, blame.role, blame.phase, MemoryHeld(state.reason))


async def bootstrap(
    workers: Workers, ranks: Sequence[int], deadline_s: float
) -> list[BootstrapResult]:
    """Every worker of `ranks` loads the last committed checkpoint; the trainers' results, in
    the order of `ranks`."""
    results: dict[int, BootstrapResult] = {}

    async def load(worker: WorkerId) -> None:
        returns = result_type("bootstrap", worker.role)
        result = await workers.call(worker, "bootstrap", deadline_s=deadline_s, returns=returns)
        if isinstance(result, BootstrapResult):
            results[worker.rank] = result

    await _on_every_worker(ranks, load, "bootstrap")
    return [results[rank] for rank in ranks]


async def run_phase(
    workers: Workers,
    rank: int,
    phase: Phase,
    params: dict[str, PhaseParams],
    deadline_s: float,
) -> dict[str, CommandResult]:
    """Both workers of `rank` run `phase` with their `params` (by role); their results."""
    started = time.monotonic()
    calls = [
        LaneCall(WorkerId(role, rank), phase.value, params[role], result_type(phase.value, role))
        for role in ROLES
    ]
    try:
        results = await workers.call_all(calls, deadline_s=deadline_s)
    except WorkerFailure as failure:
        raise cycle_failed(rank, failure.role, phase.value, failure, started=started) from failure
    by_role: dict[str, CommandResult] = {}
    for role, result in zip(ROLES, results, strict=True):
        assert isinstance(result, CommandResult), result  # each decoded as its call's `returns`
        by_role[role] = result
    return by_role


async def meet_at_barrier(meeting: NodeMeeting, rank: int, timeout_s: float) -> None:
    """This rank (numbered on its node) waits for every rank of its node; a timeout is the
    waiting rank's failure, naming those that did not come."""
    started = time.monotonic()
    try:
        await meeting.meet(rank, timeout_s=timeout_s)
    except CollectiveTimeout as exc:
        blame = meeting.first_rank + rank
        raise cycle_failed(blame, "trainer", Phase.BARRIER.value, exc, started=started) from exc


async def cross_nodes(
    crossing: NodeCrossing,
    value: B | Callable[[JobStore], B],
    fold: Callable[[list[B]], A],
    *,
    brought_as: type[B],
    agreed_as: type[A],
    following: Phase,
    ranks_per_node: int,
    timeout_s: float,
) -> A:
    """This node waits for every other node at the fence before `following`; `fold` of what
    each brought. A node that does not come is the run's failure, named with its ranks (the
    first of them, if several: the message lists all)."""
    try:
        return await crossing.cross(
            value, fold, brought_as=brought_as, agreed_as=agreed_as, timeout_s=timeout_s
        )
    except CollectiveTimeout as exc:  # (a store gone is StoreError: the caller's to name)
        node = exc.missing[0]
        ranks = ranks_of_node(node, ranks_per_node)
        raise node_failed(node, ranks, following.value, exc) from exc


async def held_memory(
    workers: Workers, ranks: Sequence[int], deadline_s: float
) -> tuple[Held, ...]:
    """What device memory every worker says it holds (the job stands at the pause boundary)."""
    held: dict[WorkerId, HeldResult] = {}

    async def ask(worker: WorkerId) -> None:
        result = await workers.call(worker, "held", deadline_s=deadline_s, returns=HeldResult)
        held[worker] = result

    await _on_every_worker(ranks, ask, "pause")
    in_order = sorted(held.items(), key=lambda item: (item[0].rank, item[0].role != "trainer"))
    return tuple(
        Held(worker.role, worker.rank, result.held_mb, result.resident_mb)
        for worker, result in in_order
    )


async def _on_every_worker(
    ranks: Sequence[int], ask: Callable[[WorkerId], Coroutine[object, object, None]], what: str
) -> None:
    """`ask` every worker at once; the first failure is the run's, naming its worker and `what`."""
    try:
        async with anyio.create_task_group() as group:
            for rank in ranks:
                for role in ROLES:
                    group.start_soon(ask, WorkerId(role, rank))
    except* WorkerFailure as failures:
        first = failures.exceptions[0]
        assert isinstance(first, WorkerFailure)
        raise cycle_failed(first.rank, first.role, what, first) from first
