"""The protocol peers of `benchmarks/scale.py --peers` stand in for whole nodes: a real leader
runs its steps with them as it would with real followers, and they leave when it does.

If the daemon's side of the node protocol changes (the start's agreement, the crossings, the
beat, the leader's wait for every node's last word) and the peers no longer speak it, the leader
waits at a fence or for a last word that never comes, and this test fails; the benchmark's
figures would be of a job that no longer exists.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.configs import FAST
from tests.nodes.cluster import assert_nodes_left_nothing, node_configs, running_nodes
from tests.ports import free_port
from timeshare.protocols.nodes import BEAT_S, NodeBeat, read_record, record_key
from timeshare.protocols.store import JobStore, state_key
from timeshare.state import Lifecycle, initial_state

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
NODES = 3
STEPS = 4


def test_a_leader_runs_its_steps_with_protocol_peers_and_they_leave_with_it(
    runtime_dir: Path,
) -> None:
    port = free_port()
    leader, *_ = node_configs(
        runtime_dir,
        FAST,
        port,
        nodes=NODES,
        job={"ranks": NODES, "steps": STEPS},
        deadlines={"phase_s": 30.0, "stall_s": 10.0, "node_s": 10.0},
    )
    with running_nodes([leader]) as [run]:
        peers = subprocess.Popen(
            [sys.executable, str(PEERS), "--port", str(port), "--nodes", str(NODES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            code, out = run.wait(timeout=180)
            peers_out, _ = peers.communicate(timeout=30)
        finally:
            if peers.poll() is None:
                peers.kill()
                peers.communicate(timeout=30)
    assert code == 0, out
    assert f"stopped at step {STEPS}" in out
    assert peers.returncode == 0, peers_out
    # Each peer crossed the three fences of every step (the last step's cross>train is the
    # leader's last; a peer waiting at the next is called off when the leader stops).
    said = json.loads(peers_out.rsplit("peers: ", 1)[1])
    crossed = said["crossings"]
    assert sorted(crossed) == ["1", "2"], peers_out
    assert all(count >= 3 * STEPS - 1 for count in crossed.values()), peers_out
    assert_nodes_left_nothing(runtime_dir, nodes=1)


def test_the_peers_leave_when_the_store_goes_away_naming_it(runtime_dir: Path) -> None:
    """A leader gone (its store with it) ends the peers with an error, not a hang."""
    store = JobStore.host("127.0.0.1", free_port())
    port = store.address[1]
    peers = subprocess.Popen(
        [sys.executable, str(PEERS), "--port", str(port), "--nodes", "3", "--lost-s", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        reader = JobStore.connect("127.0.0.1", port)
        # Both peers wait at the start's crossing (generation 1 of cycle 1's) for the leader.
        arrived = [f"barrier/crossing/1/1/{node}" for node in (1, 2)]
        reader.wait([state_key(1), state_key(2), *arrived], timeout_s=60)
        del reader, store  # the store's host goes away (as with its leader's daemon)
        out, _ = peers.communicate(timeout=120)
    finally:
        if peers.poll() is None:
            peers.kill()
            peers.communicate(timeout=30)
    assert peers.returncode != 0, out
    assert f"peers: the job store went away: job store at 127.0.0.1:{port}" in out, out


def test_a_failed_leader_ends_the_peers_with_their_last_word(runtime_dir: Path) -> None:
    """The leader's record says failed: the peers leave at once, each with a last record the
    leader's daemon would wait for (failed, naming why), and exit 2 naming the leader."""
    store = JobStore.host("127.0.0.1", free_port())
    port = store.address[1]
    leader = NodeBeat(JobStore.connect("127.0.0.1", port), 0, 3, 1, lost_s=30.0)
    leader.update(dataclasses.replace(initial_state(1, nodes=3), lifecycle=Lifecycle.RUNNING))
    peers = subprocess.Popen(
        [sys.executable, str(PEERS), "--port", str(port), "--nodes", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        leader.write()
        # Once both peers beat (each starts loading torch first), they see the leader's beat
        # move: a live daemon's record, whose failure then counts.
        JobStore.connect("127.0.0.1", port).wait([record_key(1), record_key(2)], timeout_s=60.0)
        for _ in range(4):
            leader.write()
            time.sleep(BEAT_S)
        failed = initial_state(1, nodes=3)
        leader.update(dataclasses.replace(failed, lifecycle=Lifecycle.FAILED, reason="an OOM"))
        leader.write()
        out, _ = peers.communicate(timeout=60)
    finally:
        if peers.poll() is None:
            peers.kill()
            peers.communicate(timeout=30)
    assert peers.returncode == 2, out
    assert "peers: the leader failed: node 0 (ranks 0-0) failed: an OOM" in out, out
    for node in (1, 2):
        record = read_record(store, node)
        assert record is not None and record.lifecycle == "failed", record
        assert record.reason is not None and "an OOM" in record.reason
