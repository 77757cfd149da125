"""The nodes of one job, over its store: each daemon's beat, and the fences they cross together.

Every node's daemon writes its record (`node/<n>`: its ranks, where its job stands, a beat
counter) every BEAT_S; every node reads all records at the same pace. A node whose beat has not
moved for the lost deadline is gone (`NodeLost`), and a node that cannot write its own has lost
the job store (the leader's daemon, which hosts it, is gone). The records are also what
`timesharectl status` shows on any node.

A crossing is a store barrier of the nodes (not of the ranks): each node arrives once its own
ranks stand at the fence, bringing a small JSON value (the last command it has seen), and learns
every node's.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from timeshare.errors import CollectiveTimeout, NodeLost, StoreError
from timeshare.protocols.barrier import Barrier
from timeshare.protocols.store import JobStore
from timeshare.state import JobState

BEAT_S = 0.5
CROSSING = "crossing"


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What one node's daemon says about itself, for every other node and for operators."""

    node: int
    ranks: list[int]
    host: str
    pid: int
    beat: int  # moves every BEAT_S while the daemon lives
    at: float  # wall-clock time of the beat (status shows its age; skew between hosts shows)
    lifecycle: str = "starting"
    step: int = 0
    phases: list[str] = []
    reason: str | None = None


def record_key(node: int) -> str:
    return f"node/{node}"


def store_lost(
    address: tuple[str, int], node: int, ranks_per_node: int, exc: BaseException
) -> NodeLost:
    """This node can no longer reach the job store: its host, the leader, is gone."""
    host, port = address
    return NodeLost(
        f"node {node} lost the job store at {host}:{port} (the leader's daemon, node 0, hosts "
        f"it): {exc}",
        node=0,
        ranks=range(ranks_per_node),
    )


@dataclass
class NodeBeat:
    """This node's record and beat, and what it last saw of every node's (one connection)."""

    store: JobStore
    node: int
    nodes: int
    ranks_per_node: int
    lost_s: float
    beat: int = 0
    judging: bool = False  # set once every node came: before, one may not have started yet
    lifecycle: str = "starting"
    step: int = 0
    phases: list[str] = field(default_factory=list)
    reason: str | None = None
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # node -> (beat, moved at)
    records: dict[int, NodeRecord] = field(default_factory=dict)

    def update(self, state: JobState) -> None:
        """What this node's next record says (the loop writes, the beat's thread reads)."""
        self.lifecycle, self.step = state.lifecycle.value, state.step
        self.phases = [phase.value for phase in state.phases]
        self.reason = state.reason

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def beat_once(self) -> list[NodeRecord]:
        """Write this node's record, read every node's; raise `NodeLost` for a node gone quiet
        for `lost_s` (or for the leader, when the store itself is gone). Blocking: a thread's."""
        self.beat += 1
        own = NodeRecord(
            node=self.node,
            ranks=list(self.ranks_of(self.node)),
            host=socket.gethostname(),
            pid=os.getpid(),
            beat=self.beat,
            at=time.time(),
            lifecycle=self.lifecycle,
            step=self.step,
            phases=self.phases,
            reason=self.reason,
        )
        try:
            self.store.put(record_key(self.node), msgspec.to_builtins(own))
            records = [self._read(node) for node in range(self.nodes)]
        except StoreError as exc:
            raise store_lost(self.store.address, self.node, self.ranks_per_node, exc) from exc
        now = time.monotonic()
        for record in records:
            if record is None:
                continue
            self.records[record.node] = record
            last = self.seen.get(record.node)
            if last is None or last[0] != record.beat:
                self.seen[record.node] = (record.beat, now)
            if not self.judging or record.node == self.node:
                continue
            if record.lifecycle == "failed":
                raise self._failed(record)
            if record.lifecycle == "stopped":
                continue  # it drained and left: quiet from now on, and rightly so
            if last is not None and last[0] == record.beat and now - last[1] > self.lost_s:
                raise self.lost(record.node, now - last[1])
        return [self.records[node] for node in sorted(self.records)]

    def _failed(self, record: NodeRecord) -> NodeLost:
        ranks = self.ranks_of(record.node)
        return NodeLost(
            f"node {record.node} (ranks {ranks.start}-{ranks.stop - 1}) failed: {record.reason}",
            node=record.node,
            ranks=ranks,
        )

    def lost(self, node: int, silent_s: float) -> NodeLost:
        ranks = self.ranks_of(node)
        return NodeLost(
            f"node {node} (ranks {ranks.start}-{ranks.stop - 1}) is lost: its daemon's record "
            f"in the job store has not moved for {silent_s:.1f} s",
            node=node,
            ranks=ranks,
        )

    def _read(self, node: int) -> NodeRecord | None:
        if not self.store.has(record_key(node)):
            return None
        return msgspec.convert(self.store.read(record_key(node)), NodeRecord)


@dataclass
class NodeCrossing:
    """This node's handle on the fences it crosses with every other node (its own connection)."""

    barrier: Barrier
    name: str  # unique to the cycle: a later cycle on the same store starts afresh

    @classmethod
    def of(cls, store: JobStore, node: int, nodes: int, cycle: int) -> NodeCrossing:
        return cls(Barrier(store, node, nodes), f"{CROSSING}/{cycle}")

    async def cross(self, value: dict[str, Any], *, timeout_s: float) -> list[dict[str, Any]]:
        """Arrive with `value`, wait for every node; what every node brought, by node."""
        try:
            generation = await self.barrier.wait(self.name, timeout_s=timeout_s, value=value)
        except CollectiveTimeout as exc:
            missing = ", ".join(f"node {n}" for n in exc.missing)
            raise CollectiveTimeout(
                f"{missing} did not reach the fence within {timeout_s:g} s (crossing "
                f"{exc.generation} of {self.name})",
                name=exc.name,
                generation=exc.generation,
                missing=exc.missing,
            ) from exc
        values = await anyio.to_thread.run_sync(self.barrier.values, self.name, generation)
        return [dict(v) for v in values]
