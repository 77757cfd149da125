"""A node's dealings with the other nodes (cycle/nodes.py), two nodes in one process over a real
job store on loopback: they agree at the start, cross a fence with the commands either had read,
and a node gone quiet is the other's run's failure, naming it. On one node: no beat, no crossing.
(tests/nodes/ proves the same of whole daemons, killed.)"""

from __future__ import annotations

from typing import TypeVar

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from timeshare.config import DeadlineSection
from timeshare.cycle.commands import CommandFeed
from timeshare.cycle.hooks import CycleHooks
from timeshare.cycle.nodes import NodeCoordinator
from timeshare.cycle.telling import Telling
from timeshare.cycle.workers import Workers
from timeshare.errors import CycleFailed, NodeLost, StoreError
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.commands.params import LogLevelParams, PhaseParams
from timeshare.protocols.store import AsyncJobStore
from timeshare.state import Commanded, Crossed, Phase, Request, Requested, initial_state

DEADLINES = DeadlineSection(node_s=0.5, phase_s=5.0, barrier_s=5.0, ready_s=5.0)
RUN_S = 30.0
R = TypeVar("R")

Reports = MemoryObjectReceiveStream[Crossed | CycleFailed | Commanded]


class NoWorkers(Workers):
    """Workers for a command feed that only meets a pause: none of them is asked anything."""

    async def wait_ready(self, *, timeout_s: float) -> None:
        raise AssertionError("not asked")

    async def call(
        self,
        worker: WorkerId,
        command: str,
        params: PhaseParams | None = None,
        *,
        deadline_s: float,
        returns: type[R],
    ) -> R:
        raise AssertionError("not asked")

    async def control(
        self,
        worker: WorkerId,
        command: str,
        params: LogLevelParams | None = None,
        *,
        timeout_s: float,
        returns: type[R],
    ) -> R:
        raise AssertionError("not asked")

    async def shut_down(self, *, deadline_s: float) -> None:
        raise AssertionError("not asked")


def coordinator(store: AsyncJobStore, node: int, nodes: int) -> tuple[NodeCoordinator, Reports]:
    """Node `node`'s coordinator (one rank a node), its job still starting; its inbox."""
    send, reports = anyio.create_memory_object_stream[Crossed | CycleFailed | Commanded](100)
    state = initial_state(1, nodes=nodes, first_rank=node)
    coordinating = NodeCoordinator(
        store,
        Telling(CycleHooks(), node),
        send,
        node=node,
        nodes=nodes,
        ranks=1,
        job_state=lambda: state,
        deadlines=lambda: DEADLINES,
    )
    return coordinating, reports


async def two_nodes() -> list[tuple[NodeCoordinator, Reports]]:
    leader = await AsyncJobStore.host()
    follower = AsyncJobStore(await leader.another_connection())
    return [coordinator(leader, 0, 2), coordinator(follower, 1, 2)]


@pytest.mark.asyncio
async def test_on_one_node_there_is_no_beat_and_no_crossing() -> None:
    one, _ = coordinator(await AsyncJobStore.host(), 0, 1)
    async with anyio.create_task_group() as run:
        await one.start_beating(run)
    assert one.beat is None
    assert await one.agree_at_start(1, step=3, commands=5, load_s=1.0) == (3, 5)
    await one.last_word()  # nothing to write, nobody to wait for
    assert one.failure_of_lost() is None


@pytest.mark.asyncio
async def test_two_nodes_agree_on_the_smallest_step_and_commands_then_cross_a_fence() -> None:
    nodes = await two_nodes()
    brought = {0: (3, 4), 1: (2, 6)}  # (step, commands) each node loaded and had read
    agreed: dict[int, tuple[int, int]] = {}
    await nodes[0][0].store.record_command("pause")  # written before the crossing: read by both

    async def node(index: int) -> None:
        coordinating, reports = nodes[index]
        async with anyio.create_task_group() as run:
            await coordinating.start_beating(run)
            step, commands = brought[index]
            agreed[index] = await coordinating.agree_at_start(1, step, commands, load_s=5.0)
            feed = CommandFeed(coordinating.store, coordinating.reports, 0, NoWorkers(), [])
            coordinating.start_crossing(run, Phase.RESUME, feed)
            assert await reports.receive() == Commanded(1, Requested(Request.PAUSE))
            assert await reports.receive() == Crossed(Phase.RESUME, 1)
            run.cancel_scope.cancel()

    with anyio.fail_after(RUN_S):
        async with anyio.create_task_group() as both:
            both.start_soon(node, 0)
            both.start_soon(node, 1)
    assert agreed == {0: (2, 4), 1: (2, 4)}
    assert [coordinating.failure_of_lost() for coordinating, _ in nodes] == [None, None]


@pytest.mark.asyncio
async def test_a_node_gone_quiet_cancels_the_others_run_naming_it() -> None:
    (leader, _), (follower, _) = await two_nodes()

    async def node(coordinating: NodeCoordinator, step: int) -> None:
        async with anyio.create_task_group() as run:
            await coordinating.start_beating(run)
            await coordinating.agree_at_start(1, step, 0, load_s=5.0)
            if coordinating is follower:
                run.cancel_scope.cancel()  # its daemon goes quiet (SIGKILLed, say)
            await anyio.sleep_forever()  # the leader's run: until its beat finds node 1 gone

    with anyio.fail_after(RUN_S):
        async with anyio.create_task_group() as both:
            both.start_soon(node, leader, 1)
            both.start_soon(node, follower, 1)
    failed = leader.failure_of_lost()
    assert failed is not None and isinstance(failed.cause, NodeLost)
    assert (failed.rank, failed.role, failed.phase) == (1, "node", "start")
    assert "node 1 (ranks 1-1)" in str(failed) and "has not moved" in str(failed)
    assert follower.failure_of_lost() is None


@pytest.mark.asyncio
async def test_a_lost_store_is_the_leaders_failure() -> None:
    follower, _ = coordinator(await AsyncJobStore.host(), 1, 2)
    failed = follower.store_lost(StoreError("connection reset"))
    assert (failed.rank, failed.role, failed.phase) == (0, "node", "start")
    host, port = follower.store.address
    assert f"node 1 lost the job store at {host}:{port}" in str(failed)
