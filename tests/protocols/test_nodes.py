"""How a node judges the others from their records in a real job store: silent, failed,
stopped, restarted; and when the leader may leave (every other node finished)."""

from __future__ import annotations

import time

import msgspec
import pytest

from timeshare.errors import NodeLost
from timeshare.protocols.nodes import (
    BEAT_S,
    FULL_READ_NODES,
    NodeBeat,
    NodeRecord,
    NodeSeen,
    record_key,
)
from timeshare.protocols.store import JobStore, Json

LOST_S = 0.3


def beats(store: JobStore, node: int) -> NodeBeat:
    return NodeBeat(JobStore.connect(*store.address), node, 3, 2, lost_s=LOST_S, judging=True)


def other(
    store: JobStore,
    node: int,
    beat: int,
    lifecycle: str = "running",
    *,
    pid: int = 7,
    reason: str = "boom",
) -> None:
    """What node `node`'s daemon (pid `pid`) writes of itself (`reason`: why it failed)."""
    record = NodeRecord(
        node=node,
        ranks=[2 * node, 2 * node + 1],
        host="h",
        pid=pid,
        beat=beat,
        at=0.0,
        lifecycle=lifecycle,
        reason=reason if lifecycle == "failed" else None,
    )
    store.put(record_key(node), msgspec.to_builtins(record))


def test_nodes_that_beat_are_alive_and_every_record_is_shown() -> None:
    store = JobStore.host()
    leader = beats(store, 0)
    for beat in range(1, 4):
        other(store, 1, beat)
        other(store, 2, beat)
        seen = leader.beat_once()
        time.sleep(LOST_S / 2)
    assert [(s.record.node, s.record.ranks) for s in seen] == [
        (0, [0, 1]),
        (1, [2, 3]),
        (2, [4, 5]),
    ]


def test_a_beats_age_is_on_the_readers_clock_and_silence_follows_the_deadline() -> None:
    store = JobStore.host()
    leader = beats(store, 0)
    other(store, 1, 1)  # its `at` is 0.0: wall time of 1970, as a host with a wrong clock says
    other(store, 2, 1)
    leader.beat_once()
    time.sleep(0.2)
    other(store, 2, 2)  # node 2 beats on, node 1 does not
    seen = {s.record.node: s for s in leader.beat_once()}
    now = time.monotonic()
    moved, still = seen[2].view(now, silent_after_s=0.15), seen[1].view(now, silent_after_s=0.15)
    moved_age, still_age = moved["beat_age_s"], still["beat_age_s"]
    assert isinstance(moved_age, float) and isinstance(still_age, float)
    assert moved_age < 0.1 and not moved["silent"]  # not 56 years
    assert 0.2 <= still_age < 5.0 and still["silent"]
    assert not seen[1].view(now, silent_after_s=10.0)["silent"]  # a longer node_s: not yet


def test_a_node_silent_past_its_deadline_is_lost_naming_its_ranks() -> None:
    store = JobStore.host()
    leader = beats(store, 0)
    other(store, 1, 1)
    other(store, 2, 1)
    leader.beat_once()
    time.sleep(LOST_S + 0.1)
    other(store, 2, 2)  # node 2 beats on, node 1 does not
    with pytest.raises(NodeLost, match=r"node 1 \(ranks 2-3\) is lost: .* has not moved") as info:
        leader.beat_once()
    assert (info.value.node, info.value.ranks) == (1, range(2, 4))


def test_a_failed_node_ends_the_run_at_once_and_a_stopped_one_never() -> None:
    store = JobStore.host()
    leader = beats(store, 0)
    other(store, 1, 1)
    other(store, 2, 1)
    leader.beat_once()
    other(store, 1, 2, "stopped")
    other(store, 2, 2, "failed")
    with pytest.raises(NodeLost, match=r"node 2 \(ranks 4-5\) failed: boom"):
        leader.beat_once()
    time.sleep(LOST_S + 0.1)  # node 1 stopped: quiet from now on, and never lost
    other(store, 2, 3)
    leader.beat_once()


def test_a_failed_record_of_an_earlier_run_is_not_this_run_failing() -> None:
    store = JobStore.host()
    other(store, 1, 9, "failed")  # left by a daemon of a run before
    leader = beats(store, 0)
    leader.nodes = 2
    leader.beat_once()  # it has not moved since: not this run's
    other(store, 1, 1)
    leader.beat_once()


def test_a_node_whose_daemon_restarted_mid_run_is_lost() -> None:
    store = JobStore.host()
    leader = beats(store, 0)
    leader.nodes = 2
    other(store, 1, 57, pid=7)
    leader.beat_once()
    other(store, 1, 1, pid=8)  # a new daemon within the deadline
    with pytest.raises(NodeLost, match=r"node 1 \(ranks 2-3\) restarted .* pid 8"):
        leader.beat_once()


def test_the_leader_may_leave_once_every_other_node_finished() -> None:
    store = JobStore.host()
    leader = beats(store, 0)
    other(store, 1, 1)
    other(store, 2, 1)
    leader.beat_once()
    assert not leader.others_finished()
    other(store, 1, 2, "stopped")
    other(store, 2, 2, "failed")
    assert leader.others_finished()


def test_a_lost_store_is_the_leader_lost() -> None:
    store = JobStore.host()
    follower = NodeBeat(JobStore.connect(*store.address), 1, 2, 2, lost_s=LOST_S)
    follower.beat_once()
    del store  # the leader's process hosted it
    with pytest.raises(NodeLost, match=r"node 1 lost the job store at .* node 0, hosts it") as info:
        for _ in range(50):
            follower.beat_once()
            time.sleep(0.05)
    assert (info.value.node, info.value.ranks) == (0, range(0, 2))


def test_a_follower_leaves_the_other_followers_silence_to_the_leader() -> None:
    store = JobStore.host()
    follower = beats(store, 1)
    other(store, 0, 1)
    other(store, 2, 1)
    follower.beat_once()
    time.sleep(LOST_S + 0.1)
    other(store, 0, 2)  # the leader beats on, node 2 does not: the leader's to judge
    follower.beat_once()
    time.sleep(LOST_S + 0.1)  # now the leader is quiet too
    with pytest.raises(NodeLost, match=r"node 0 \(ranks 0-1\) is lost: .* has not moved"):
        follower.beat_once()


def test_the_leaders_failure_names_the_node_it_found_gone() -> None:
    store = JobStore.host()
    follower = beats(store, 1)
    other(store, 0, 1)
    follower.beat_once()
    lost = "node 2 (ranks 4-5) is lost: its daemon's record has not moved for 3.1 s"
    other(store, 0, 2, "failed", reason=lost)
    with pytest.raises(
        NodeLost, match=r"node 0 \(ranks 0-1\) failed: node 2 \(ranks 4-5\) is lost"
    ):
        follower.beat_once()


class CountingReads:
    """A connection that counts the records each read asks for."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.reads: list[int] = []

    def read_present(self, keys: list[str]) -> list[Json]:
        self.reads.append(len(keys))
        return self.store.read_present(keys)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def test_a_follower_of_many_nodes_reads_the_leader_each_beat_and_every_node_now_and_then() -> None:
    store = JobStore.host()
    nodes = 4 * FULL_READ_NODES  # a follower reads every record one beat in four
    reads = CountingReads(JobStore.connect(*store.address))
    follower = NodeBeat(reads, 1, nodes, 2, lost_s=60.0, judging=True)  # type: ignore[arg-type]
    for node in range(nodes):
        other(store, node, 1)
    seen = [follower.beat_once() for _ in range(5)]
    assert reads.reads == [nodes, 2, 2, 2, nodes]
    assert [s.record.node for s in seen[1]] == list(range(nodes))  # as last read
    # Status allows for that: another follower's beat age may be 3 beats older than its own.
    lags = {s.record.node: s.read_lag_s for s in seen[1]}
    assert (lags[0], lags[1], lags[2]) == (0.0, 0.0, 3 * BEAT_S)
    assert beats(store, 0).full_every == 1  # the leader reads every record at every beat
    other(store, 9, 2, "failed")  # read on the next whole beat, the ninth: it ends the run
    for _ in range(3):
        follower.beat_once()
    with pytest.raises(NodeLost, match=r"node 9 \(ranks 18-19\) failed: boom"):
        follower.beat_once()
    assert reads.reads[5:] == [2, 2, 2, nodes]


def test_status_allows_for_how_seldom_a_node_is_read() -> None:
    record = NodeRecord(node=5, ranks=[10, 11], host="h", pid=7, beat=1, at=0.0)
    now = time.monotonic()
    read_every_beat = NodeSeen(record=record, still_since=now - 2.0)
    read_seldom = NodeSeen(record=record, still_since=now - 2.0, read_lag_s=1.5)
    assert read_every_beat.view(now, silent_after_s=1.0)["silent"]
    assert not read_seldom.view(now, silent_after_s=1.0)["silent"]
    assert read_seldom.view(now, silent_after_s=0.4)["silent"]


def test_a_follower_takes_a_restart_before_judging_read_only_after_it_as_joining() -> None:
    """A follower of 64 nodes reads node 9 one beat in four: node 9's daemon restarted before
    the run began, but this follower reads the new one only once judging has begun. That node
    joined; a restart after that is a node lost."""
    store = JobStore.host()
    nodes = 4 * FULL_READ_NODES
    follower = NodeBeat(JobStore.connect(*store.address), 1, nodes, 2, lost_s=60.0)
    for node in range(nodes):
        other(store, node, 1)
    follower.beat_once()  # whole: node 9 is pid 7
    other(store, 9, 1, pid=8)  # restarted, before the run began
    follower.judging = True
    for beat in range(2, 6):  # the fifth is whole: it reads pid 8 for the first time
        other(store, 0, beat)
        follower.beat_once()
    other(store, 9, 2, pid=9)  # a restart now
    with pytest.raises(NodeLost, match=r"node 9 \(ranks 18-19\) restarted .* pid 9"):
        for beat in range(6, 10):
            other(store, 0, beat)
            follower.beat_once()
