"""The nodes of one job, over its store: each daemon's beat, and the fences they cross together.

Every node's daemon writes its record (`node/<n>`: its ranks, where its job stands, a beat
counter) every BEAT_S. The leader reads every record at that pace and judges every node: one
whose beat has not moved for the lost deadline is gone (`NodeLost`), and the leader's run fails
naming it. A follower judges the leader alone, from the leader's record: gone quiet, or failed
(and then its reason names the node the leader found gone); a node that cannot write its own
record has lost the job store (the leader's daemon, which hosts it, is gone). So the store
sends O(n) records a beat, not n^2: at 1,024 nodes every node reading every record was ~670 MB/s
out of the leader's store.

A follower still reads every record on one beat in `full_every` (every beat up to
FULL_READ_NODES nodes, every ceil(n / FULL_READ_NODES) beats beyond): they are what
`timesharectl status` shows on any node, and a failed or restarted node read there ends the run
at once. Between such beats its view of the other followers ages.

A crossing is a store barrier of the nodes (not of the ranks): each node arrives once its own
ranks stand at the fence, bringing a small JSON value (the last command it has seen), and learns
every node's.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from timeshare.cluster import ranks_of_node
from timeshare.errors import CollectiveTimeout, NodeLost, StoreError
from timeshare.protocols.barrier import Barrier
from timeshare.protocols.store import JobStore, Json
from timeshare.state import JobState

T = TypeVar("T")
B = TypeVar("B", bound=msgspec.Struct)  # what each node brings to a crossing
A = TypeVar("A", bound=msgspec.Struct)  # what the nodes agree at it
BEAT_S = 0.5
# Up to this many nodes a follower reads every record at every beat (as the leader always does);
# beyond, one beat in ceil(nodes / FULL_READ_NODES): the store sends at most this many records
# per follower's beat, on average, however many nodes there are.
FULL_READ_NODES = 16
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


class NodeSeen(msgspec.Struct, frozen=True, kw_only=True):
    """A node's record as this node last read it, and since when (this process's
    `time.monotonic()`) its beat has not moved: its age is measured on the reader's clock, never
    against the writer's wall clock (hosts' clocks differ)."""

    record: NodeRecord
    still_since: float
    # How stale this reader's view of it may be beyond a beat: a follower reads the other
    # followers one beat in `full_every` (their beat's age may be that much older).
    read_lag_s: float = 0.0

    def view(self, now: float, silent_after_s: float) -> dict[str, object]:
        """The record as status shows it: with its beat's age at `now` (monotonic) and whether
        that is past `silent_after_s` (the job's `deadlines.node_s`)."""
        age = max(now - self.still_since, 0.0)
        return {
            **msgspec.to_builtins(self.record),
            "beat_age_s": round(age, 3),
            "silent": age > silent_after_s + self.read_lag_s,
        }


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
        ranks=ranks_of_node(0, ranks_per_node),
    )


@dataclass
class _Seen:
    """What this node last saw of another's record: its daemon, its beat and when it moved."""

    daemon: tuple[str, int]  # (host, pid): a new one is a restarted daemon
    beat: int
    moved_at: float
    live: bool = False  # its beat moved while we watched: its record is of this run
    # This daemon was read while judging: a new one after it is a restart. (A follower may read
    # another follower seldom: one that restarted before judging began may first be read after.)
    judged: bool = False


@dataclass
class NodeBeat:
    """This node's record and beat, and what it last saw of every node's (one connection).

    The rules for another node: a daemon that wrote its record while we watched and says
    failed has failed; one that says stopped has drained and left; once every node has come
    (`judging`), a record that a new daemon wrote (the node restarted: its part of the run is
    gone) is a node lost, and so is one that has not moved for `lost_s`, judged by the leader
    for every node and by a follower for the leader only (a follower does not read the others
    at every beat: see the module's note).
    """

    store: JobStore
    node: int
    nodes: int
    ranks_per_node: int
    lost_s: float
    beat: int = 0
    judging: bool = False  # set once every node came: before, one may not have started yet
    # What this node's next record says: the loop sets it whole, the beat's thread reads it.
    state: JobState | None = None
    seen: dict[int, _Seen] = field(default_factory=dict)
    last: dict[int, NodeRecord] = field(default_factory=dict)  # every node's, as last read

    def update(self, state: JobState) -> None:
        self.state = state

    def ranks_of(self, node: int) -> range:
        return ranks_of_node(node, self.ranks_per_node)

    @property
    def full_every(self) -> int:
        """A follower reads every node's record one beat in this many (the leader: every)."""
        return 1 if self.node == 0 else -(-self.nodes // FULL_READ_NODES)

    def beat_once(self) -> list[NodeSeen]:
        """Write this node's record, read the records this beat reads (`full_every`); raise
        `NodeLost` for a node the rules say is gone (or for the leader, when the store itself
        is gone). Every node's record as last read. Blocking: a thread's."""
        self.write()
        whole = (self.beat - 1) % self.full_every == 0
        read = range(self.nodes) if whole else sorted({0, self.node})
        records = self._read(read)
        now = time.monotonic()
        for record in records:
            lost = self._judge(record, now)
            if lost is not None:
                raise lost
        lag_s = (self.full_every - 1) * BEAT_S
        return [
            NodeSeen(
                record=record,
                still_since=self.seen[node].moved_at,
                read_lag_s=0.0 if node in (0, self.node) else lag_s,
            )
            for node, record in sorted(self.last.items())
        ]

    def others_finished(self) -> bool:
        """Whether every other node has stopped, failed or gone quiet: nobody needs the store
        any more (the leader, which hosts it, waits for this before it leaves)."""
        now = time.monotonic()
        for record in self._read(range(self.nodes)):
            seen = self.seen[record.node]
            quiet = now - seen.moved_at > self.lost_s
            final = record.lifecycle in ("stopped", "failed")
            if record.node != self.node and not (final or quiet):
                return False
        return True

    def write(self) -> None:
        """Write this node's record (a beat)."""
        self.beat += 1
        state = self.state  # (one read: the loop may set the next meanwhile)
        own = NodeRecord(
            node=self.node,
            ranks=list(self.ranks_of(self.node)),
            host=socket.gethostname(),
            pid=os.getpid(),
            beat=self.beat,
            at=time.time(),
            lifecycle="starting" if state is None else state.lifecycle.value,
            step=0 if state is None else state.step,
            phases=[] if state is None else [phase.value for phase in state.phases],
            reason=None if state is None else state.reason,
        )
        try:
            self.store.put(record_key(self.node), msgspec.to_builtins(own))
        except StoreError as exc:
            raise store_lost(self.store.address, self.node, self.ranks_per_node, exc) from exc

    def _read(self, nodes: Sequence[int]) -> list[NodeRecord]:
        """The records of `nodes` there are, in node order, each noted in `seen` and `last`."""
        try:
            values = self.store.read_present([record_key(node) for node in nodes])
            records = [None if v is None else msgspec.convert(v, NodeRecord) for v in values]
        except StoreError as exc:
            raise store_lost(self.store.address, self.node, self.ranks_per_node, exc) from exc
        now = time.monotonic()
        for record in records:
            if record is not None:
                self._note(record, now)
                self.last[record.node] = record
        return [record for record in records if record is not None]

    def _note(self, record: NodeRecord, now: float) -> None:
        daemon = (record.host, record.pid)
        seen = self.seen.get(record.node)
        if seen is None or (seen.daemon != daemon and not seen.judged):
            # (a restart before the run began is no loss: it simply joins)
            self.seen[record.node] = _Seen(daemon, record.beat, now, judged=self.judging)
        elif seen.daemon == daemon:
            seen.judged = seen.judged or self.judging
            if seen.beat != record.beat:
                seen.beat, seen.moved_at, seen.live = record.beat, now, True

    def _judge(self, record: NodeRecord, now: float) -> NodeLost | None:
        if record.node == self.node:
            return None
        seen = self.seen[record.node]
        ranks = self.ranks_of(record.node)
        named = f"node {record.node} (ranks {ranks.start}-{ranks.stop - 1})"
        if seen.judged and (record.host, record.pid) != seen.daemon:
            return NodeLost(
                f"{named} restarted (its daemon is now pid {record.pid} on {record.host}): "
                "its part of the run is gone",
                node=record.node,
                ranks=ranks,
            )
        if record.lifecycle == "failed" and seen.live:
            return NodeLost(f"{named} failed: {record.reason}", node=record.node, ranks=ranks)
        # A follower leaves another follower's silence to the leader: it reads that seldom.
        judges_silence = self.node == 0 or record.node == 0
        if record.lifecycle == "stopped" or not self.judging or not judges_silence:
            return None
        if now - seen.moved_at > self.lost_s:
            return NodeLost(
                f"{named} is lost: its daemon's record in the job store has not moved for "
                f"{now - seen.moved_at:.1f} s",
                node=record.node,
                ranks=ranks,
            )
        return None


def read_record(store: JobStore, node: int) -> NodeRecord | None:
    """What node `node`'s daemon last wrote of itself (None: nothing yet). Blocking."""
    if not store.has(record_key(node)):
        return None
    return msgspec.convert(store.read(record_key(node)), NodeRecord)


@dataclass
class NodeCrossing:
    """This node's handle on the fences it crosses with every other node (its own connection)."""

    barrier: Barrier
    name: str  # unique to the cycle: a later cycle on the same store starts afresh

    @classmethod
    def of(
        cls, store: JobStore, waker: JobStore, node: int, nodes: int, cycle: int
    ) -> NodeCrossing:
        """`store` is the crossing's own connection (its wait blocks it); `waker` any other."""
        return cls(Barrier(store, node, nodes, waker), f"{CROSSING}/{cycle}")

    async def cross(
        self,
        value: B | Callable[[JobStore], B],
        fold: Callable[[list[B]], A],
        *,
        brought_as: type[B],
        agreed_as: type[A],
        timeout_s: float,
    ) -> A:
        """Arrive with `value` (or what it reads from the store as this node arrives), wait for
        every node; `fold` of what every node brought (in node order), folded once for the job
        by the node that arrived last (`Barrier.agree`). What a node brings and what they agree
        are Structs: a value of the wrong shape is a `StoreError` naming the crossing."""

        def bring(store: JobStore) -> object:
            return msgspec.to_builtins(value(store) if callable(value) else value)

        def fold_values(values: list[Json]) -> Json:
            brought = [self._converted(v, brought_as) for v in values]
            folded: Json = msgspec.to_builtins(fold(brought))
            return folded

        try:
            agreed = await self.barrier.agree(
                self.name, timeout_s=timeout_s, value=bring, fold=fold_values
            )
        except CollectiveTimeout as exc:
            missing = ", ".join(f"node {n}" for n in exc.missing)
            raise CollectiveTimeout(
                f"{missing} did not reach the fence within {timeout_s:g} s (crossing "
                f"{exc.generation} of {self.name})",
                name=exc.name,
                generation=exc.generation,
                missing=exc.missing,
            ) from exc
        return self._converted(agreed, agreed_as)

    def _converted(self, value: Json, kind: type[T]) -> T:
        try:
            return msgspec.convert(value, kind)
        except msgspec.ValidationError as exc:
            raise StoreError(f"{self.name}: a value of the wrong shape: {exc}") from exc
