"""Nodes 1..n-1 of a job as protocol peers: what each node's daemon does in the job store, and
nothing else, all from one process (benchmarks/scale.py --peers).

    python benchmarks/peers.py --port P --nodes 16 --ranks-per-node 1 --tag /tmp/tss-x/peers

On one 2-core machine, 16 whole nodes are 16 daemons and 32 workers taking turns on 2 cores:
every phase of the measured node then waits for the other nodes' phases, and the figure is the
machine's. On a cluster each node has cores of its own, and what the other nodes cost one node
is only what they send the job store and how long they keep it waiting at a fence. A peer does
exactly that, with the daemon's own code (protocols/nodes.py, protocols/store.py,
cycle/nodes.py's folds): it beats its record every BEAT_S, crosses every fence (the start's
agreement, then each fence with the newest command it has seen), writes its state when it
changed at most every NODES_PUBLISH_EVERY_S and polls the command counter every NODES_POLL_S.
It has no workers, so it arrives at each fence at once: the real node (the leader, node 0, which
hosts the store and reads every beat) arrives last at every crossing and its figures are its
own cost at that node count. The peers say how long they waited at a fence once arrived
(`wait_ms`, on their last line): a wait of about nothing is a peer that came last.

A peer stops when the leader's record says it stopped (exit 0), or its beat finds the leader
failed or gone quiet (exit 2, naming why); either way it writes its own last record, which the
leader waits for on its way out. The process exits 1 if the store goes away, naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from functools import partial
from typing import Any

import anyio
import anyio.to_thread

import timeshare.daemon  # noqa: F401 (first: TCPStore's C++ traces off stderr, torch_quiet.py)
from timeshare.cycle.commands import NODES_POLL_S
from timeshare.cycle.nodes import (
    CommandsSeen,
    StartAgreed,
    StartBrought,
    agreed_start,
    last_command_seen,
    newest_command,
)
from timeshare.cycle.runner import NODES_PUBLISH_EVERY_S
from timeshare.errors import NodeLost, StoreError, first_error
from timeshare.protocols.nodes import BEAT_S, NodeBeat, NodeCrossing
from timeshare.protocols.store import AsyncJobStore, JobStore
from timeshare.state import JobState, Lifecycle, initial_state

HOST = "127.0.0.1"
CONNECT_S = 60.0  # the leader's daemon hosts the store once it has started (loaded: seconds)


@dataclasses.dataclass
class Peer:
    """One node's part in the store: its connections, its state as it says it, its crossings."""

    port: int  # the leader's store, on loopback
    node: int
    nodes: int
    ranks_per_node: int
    fence_s: float  # how long a crossing may wait for the real node (its phase, its barrier)
    lost_s: float
    state: JobState = dataclasses.field(init=False)
    crossings: int = 0
    waits: list[float] = dataclasses.field(default_factory=list)  # s at each fence, arrived
    failure: str | None = None  # the leader's, as this peer's beat found it

    def __post_init__(self) -> None:
        self.state = initial_state(
            self.ranks_per_node,
            nodes=self.nodes,
            first_rank=self.node * self.ranks_per_node,
        )

    async def run(self) -> None:
        """Until the leader stops or fails (`failure`); StoreError if the store goes first."""
        connect = partial(JobStore.connect, HOST, self.port, timeout_s=CONNECT_S)
        store = AsyncJobStore(await anyio.to_thread.run_sync(connect))
        beat = NodeBeat(
            await store.another_connection(timeout_s=self.lost_s),  # as a daemon's: node_s
            self.node,
            self.nodes,
            self.ranks_per_node,
            lost_s=self.lost_s,
        )
        async with anyio.create_task_group() as group:
            group.start_soon(self._beat, beat, group.cancel_scope)
            group.start_soon(self._publish, store)
            group.start_soon(self._poll, store)
            await self._cross(store, beat)
        # The last word, as a daemon's: the leader waits for it before it leaves.
        last = Lifecycle.STOPPED if self.failure is None else Lifecycle.FAILED
        self.state = dataclasses.replace(self.state, lifecycle=last, reason=self.failure)
        beat.update(self.state)
        await anyio.to_thread.run_sync(beat.write)

    async def _cross(self, store: AsyncJobStore, beat: NodeBeat) -> None:
        """The start's agreement (as a node that loaded step 0), then every fence after it."""
        cycle = await store.next_generation(f"cycle/node/{self.node}")
        crossing = NodeCrossing.of(
            await store.another_connection(), store.blocking, self.node, self.nodes, cycle
        )
        commands = await anyio.to_thread.run_sync(store.blocking.latest_command)
        start = StartBrought(step=0, commands=commands)
        await crossing.cross(
            start,
            agreed_start,
            brought_as=StartBrought,
            agreed_as=StartAgreed,
            timeout_s=self.fence_s,
        )
        beat.judging = True
        self.state = dataclasses.replace(self.state, lifecycle=Lifecycle.RUNNING)
        while True:
            arrived = time.monotonic()
            await crossing.cross(
                last_command_seen,
                newest_command,
                brought_as=CommandsSeen,
                agreed_as=CommandsSeen,
                timeout_s=self.fence_s,
            )
            self.waits.append(time.monotonic() - arrived)
            self.crossings += 1
            self.state = dataclasses.replace(self.state, step=1 + self.crossings // 3)

    async def _beat(self, beat: NodeBeat, run: anyio.CancelScope) -> None:
        """Beat as a node does; end the peer's run when the leader's record (read by the beat
        itself) says it stopped, or the beat finds it failed or gone quiet."""
        while True:
            beat.update(self.state)
            try:
                await anyio.to_thread.run_sync(beat.beat_once)
            except NodeLost as lost:  # (its own store gone is StoreError: the run's error)
                self.failure = str(lost)
                run.cancel()
                return
            leader = beat.last.get(0)
            if leader is not None and leader.lifecycle == "stopped":
                run.cancel()
                return
            await anyio.sleep(BEAT_S)

    async def _publish(self, store: AsyncJobStore) -> None:
        """The state as a follower writes it: when it changed, at most every
        NODES_PUBLISH_EVERY_S (it changes at every crossing)."""
        published: JobState | None = None
        while True:
            if self.state is not published:
                published = self.state
                await store.publish(published, node=self.node)
            await anyio.sleep(NODES_PUBLISH_EVERY_S)

    async def _poll(self, store: AsyncJobStore) -> None:
        while True:
            await store.latest_command()
            await anyio.sleep(NODES_POLL_S)


async def run_peers(peers: list[Peer]) -> None:
    # Every peer's crossing waits in a thread, as its beat and its calls do: room for all.
    anyio.to_thread.current_default_thread_limiter().total_tokens = 4 * len(peers) + 8
    async with anyio.create_task_group() as group:
        for peer in peers:
            group.start_soon(peer.run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True, help="the job's, the real node's too")
    parser.add_argument("--first", type=int, default=1, help="the first peer's node number")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--fence-s", type=float, default=240.0)
    parser.add_argument("--lost-s", type=float, default=60.0)
    parser.add_argument("--tag", default="", help="marks this process (the run's directory)")
    args = parser.parse_args()
    if args.nodes < 2 or not 1 <= args.first < args.nodes or args.ranks_per_node < 1:
        parser.error(
            f"peers are nodes 1..n-1 of a job of n >= 2 nodes of >= 1 rank: --nodes {args.nodes}"
            f" --first {args.first} --ranks-per-node {args.ranks_per_node}"
        )
    peers = [
        Peer(args.port, node, args.nodes, args.ranks_per_node, args.fence_s, args.lost_s)
        for node in range(args.first, args.nodes)
    ]
    try:
        anyio.run(run_peers, peers)
    except BaseExceptionGroup as errors:
        lost = errors.subgroup((StoreError, NodeLost))
        if lost is None:
            raise
        print(f"peers: the job store went away: {first_error(lost)}", file=sys.stderr)
        return 1
    print(f"peers: {json.dumps(outcome(peers))}")
    failed = [peer.failure for peer in peers if peer.failure is not None]
    if failed:
        print(f"peers: the leader failed: {failed[0]}", file=sys.stderr)
        return 2
    return 0


def outcome(peers: list[Peer]) -> dict[str, Any]:
    """Each peer's crossings, and how long the peers waited at a fence once arrived: a wait
    of about nothing is a peer that came last, which the leader's figures then include."""
    waits = sorted(wait for peer in peers for wait in peer.waits)
    return {
        "crossings": {str(peer.node): peer.crossings for peer in peers},
        "wait_ms": {
            "p10": 1000 * waits[len(waits) // 10] if waits else None,
            "median": 1000 * statistics.median(waits) if waits else None,
        },
    }


if __name__ == "__main__":
    sys.exit(main())
