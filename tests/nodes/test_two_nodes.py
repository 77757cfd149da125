"""Two nodes x two ranks on loopback, each node its own `timeshare run` (or `timeshared`): one
job, every step on both, the same weights everywhere, and a command given on either node
applied by both at the same step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.configs import SERVICE, TINY
from tests.daemon.daemons import assert_daemon_left_nothing, running_daemon
from tests.daemon.test_run import steps_of
from tests.nodes.cluster import (
    assert_nodes_left_nothing,
    node_configs,
    node_dir,
    running_nodes,
)
from tests.ports import free_port
from tests.report.trace_format import check_events, check_timeline, load_trace, ns
from timeshare.protocols.commands.results import ROLES
from timeshare.protocols.store import JobStore
from timeshare.report.trace import track_of

STEPS = 5


@pytest.mark.slow
def test_two_nodes_run_one_job_with_the_same_weights_everywhere(runtime_dir: Path) -> None:
    root = runtime_dir
    port = free_port()
    configs = node_configs(root, TINY, port, job={"ranks": 4, "steps": STEPS})
    with running_nodes(configs) as runs:
        outcomes = [run.wait(timeout=240) for run in runs]
    for node, (code, out) in enumerate(outcomes):
        assert code == 0, f"node {node}: {out}"
        assert f"stopped at step {STEPS}" in out
    summaries = [steps_of(run.summary) for run in runs]
    for node, steps in enumerate(summaries):
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), node
        assert [r["rank"] for r in steps[0]["per_rank"]] == [2 * node, 2 * node + 1]
        for step in steps:
            assert step["weights_match"] and step["ranks_agree"], (node, step)
            assert step["committed_step"] == step["step"], (node, step)
    # Every trainer of the job sent the same weights: one process group over both nodes.
    for first, second in zip(*summaries, strict=True):
        assert first["weights_digest"] is not None
        assert first["weights_digest"] == second["weights_digest"], first["step"]
    assert_nodes_left_nothing(root)
    check_one_trace_of_both_nodes(root)


def check_one_trace_of_both_nodes(root: Path) -> None:
    """Both nodes' logs make one trace: a process per node, each rank on its node, lined up by
    the wall clock, in which the fence holds across nodes too."""
    merged = root / "trace.json"
    logs = [str(node_dir(root, node)) for node in (0, 1)]
    done = subprocess.run(
        [sys.executable, "-m", "timeshare", "trace", *logs, "--out", str(merged)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    events = load_trace(merged)
    check_events(events)
    check_timeline(events)
    slices = [e for e in events if e["ph"] == "X"]
    phases = [e for e in slices if e["cat"] == "phase"]
    tracks = {(e["pid"], e["tid"]) for e in phases}
    assert tracks == {(rank // 2, track_of(rank, role)) for rank in range(4) for role in ROLES}
    for step in range(1, STEPS + 1):
        of_step = [e for e in phases if e["args"]["step"] == step]
        assert len(of_step) == 4 * 2 * 6, step  # every rank, role and phase
        # Every trainer, on either node, said it held nothing before any rollout woke.
        released = max(
            end(command)
            for barrier in of_step
            if barrier["name"] == "BARRIER" and barrier["tid"] % 2 == 1  # a trainer's track
            for command in slices
            if command["name"] == "barrier" and within(command, barrier)
        )
        woke = min(ns(e["ts"]) for e in of_step if e["name"] == "RESUME")
        assert released < woke, step
    # The nodes met at each crossing together: their wall clocks agree on when.
    met = defaultdict(list)
    for event in events:
        if event["ph"] == "i" and event["name"] == "nodes met before RESUME":
            met[event["pid"]].append(ns(event["ts"]))
    assert len(met[0]) == len(met[1]) == STEPS + 1  # the bootstrap's, then every step's
    assert all(abs(a - b) < 2_000_000_000 for a, b in zip(met[0], met[1], strict=True))


def journal_of(root: Path, node: int) -> list[dict[str, Any]]:
    lines = (node_dir(root, node) / "state" / "journal.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def end(event: dict[str, Any]) -> int:
    return ns(event["ts"]) + ns(event["dur"])


def within(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    same_track = (inner["pid"], inner["tid"]) == (outer["pid"], outer["tid"])
    return same_track and ns(outer["ts"]) <= ns(inner["ts"]) and end(inner) <= end(outer)


@pytest.mark.slow
def test_a_pause_given_on_the_follower_pauses_both_nodes_at_the_same_step(
    runtime_dir: Path,
) -> None:
    root = runtime_dir
    port = free_port()
    delays = {"rollout": {str(rank): 0.05 for rank in range(4)}}
    configs = node_configs(
        root, SERVICE, port, job={"ranks": 4}, engine={"simulated": {"delays": delays}}
    )
    with (
        running_daemon(node_dir(root, 0), configs[0]) as leader,
        running_daemon(node_dir(root, 1), configs[1]) as follower,
    ):
        leader.wait_for(lambda s: s["lifecycle"] == "running" and (s["step"] or 0) >= 2)
        paused = follower.ctl("pause", "--wait")
        assert paused.returncode == 0, paused.stderr
        statuses = [d.wait_for(lambda s: s["lifecycle"] == "paused") for d in (leader, follower)]
        assert statuses[0]["step"] == statuses[1]["step"]
        step = statuses[0]["step"]
        # Either node's status shows both: their ranks, where they stand, their daemons alive.
        # (Each shows the records as its daemon last read them: twice a second.)
        for daemon in (follower, leader):
            shown = daemon.wait_for(
                lambda s: [n["lifecycle"] for n in s["nodes"]] == ["paused", "paused"]
            )
            assert [n["ranks"] for n in shown["nodes"]] == [[0, 1], [2, 3]]
            assert all(n["beat_age_s"] < 3.0 and n["step"] == step for n in shown["nodes"])
        table = leader.ctl("status")
        assert table.returncode == 0
        assert re.search(rf"node 1 +ranks 2-3  paused step {step} .* alive", table.stdout), table
        # The job store holds where each node stands under its own key (not the last writer's).
        store = JobStore.connect("127.0.0.1", port, timeout_s=30.0)
        published = [store.published(node, timeout_s=30.0) for node in (0, 1)]
        assert [(p.node, p.lifecycle, p.step) for p in published] == [
            (0, "paused", step),
            (1, "paused", step),
        ]
        # A resume on the leader runs both on; a stop on the follower stops both.
        assert leader.ctl("resume").returncode == 0

        def running_past_the_pause(status: dict[str, Any]) -> bool:
            return bool(status["lifecycle"] == "running" and status["step"] > step)

        for daemon in (leader, follower):
            daemon.wait_for(running_past_the_pause)
        stopped = follower.ctl("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert [d.process.wait(timeout=90) for d in (leader, follower)] == [0, 0]
        journal = journal_of(root, 1)
        assert any(e.get("kind") == "command" and e.get("command") == "pause" for e in journal)
    for node in range(2):
        assert_daemon_left_nothing(node_dir(root, node))


@pytest.mark.slow
def test_one_resume_or_stop_on_either_node_acts_on_both_idle_daemons(runtime_dir: Path) -> None:
    root = runtime_dir
    configs = node_configs(root, SERVICE, free_port(), job={"ranks": 4})
    with (
        running_daemon(node_dir(root, 0), configs[0]) as leader,
        running_daemon(node_dir(root, 1), configs[1]) as follower,
    ):
        both = (leader, follower)
        leader.wait_for(lambda s: s["lifecycle"] == "running" and (s["step"] or 0) >= 1)
        assert leader.ctl("drain", "--wait").returncode == 0  # both drain: idle, steps left
        drained = [d.wait_for(lambda s: s["lifecycle"] == "idle")["step"] for d in both]
        # One resume, on the follower: the leader's idle daemon hears it and starts too (else
        # the follower would wait alone for the leader at the start, and fail).
        resumed = follower.ctl("resume")
        assert resumed.returncode == 0, resumed.stderr
        for daemon, step in zip(both, drained, strict=True):

            def running_past(status: dict[str, Any], step: int = step) -> bool:
                return bool(status["lifecycle"] == "running" and status["step"] > step)

            daemon.wait_for(running_past, 90.0)
        assert follower.ctl("drain", "--wait").returncode == 0
        for daemon in both:
            daemon.wait_for(lambda s: s["lifecycle"] == "idle")
        # One stop, on the leader, while both are idle: both daemons exit.
        assert leader.ctl("stop").returncode == 0
        assert [d.process.wait(timeout=90) for d in both] == [0, 0]
    # Each heard the other's, in its journal: the leader a start, the follower a stop.
    heard = [
        [e["command"] for e in journal_of(root, node) if e.get("kind") == "node_command"]
        for node in range(2)
    ]
    assert heard == [["start"], ["stop"]]
    for node in range(2):
        assert_daemon_left_nothing(node_dir(root, node))
