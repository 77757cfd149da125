"""A node of two lost, each way: a follower SIGKILLed mid-ROLLOUT, the leader SIGKILLed
mid-SYNC. The other node fails within its deadline naming the node that is gone, nothing of the
killed one's job outlives it by 5 s, and both started again resume the job from its committed
step. And a follower whose leader never comes gives up after `ready_s`, naming the address."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.configs import SERVICE, TINY
from tests.cycle.jobs import processes_of
from tests.daemon.test_run import steps_of
from tests.nodes.cluster import (
    assert_nodes_left_nothing,
    node_configs,
    node_dir,
    running_nodes,
    wait_for_record,
)
from tests.ports import free_port
from timeshare.errors import StoreError
from timeshare.runtime import wait_gone

STEPS = 5
NODE_S = 3.0
JOB = {"ranks": 4, "steps": STEPS}
DEADLINES = {"node_s": NODE_S, "ready_s": 60.0}


def hang(role: str, rank: int, phase: str, step: int) -> dict[str, Any]:
    return {"role": role, "rank": rank, "phase": phase, "kind": "hang", "step": step}


def job_pids(root: Path, node: int) -> list[int]:
    return [p.pid for p in processes_of(node_dir(root, node) / "run")]


def assert_resumes_from(root: Path, port: int, committed: int) -> None:
    """Both nodes started again, with no fault: the job goes on from `committed`, no step is
    trained twice, and every step's figures are there on both nodes."""
    configs = node_configs(root, TINY, port, job=JOB, deadlines=DEADLINES)
    with running_nodes(configs) as runs:
        outcomes = [run.wait(timeout=240) for run in runs]
    for node, (code, out) in enumerate(outcomes):
        assert code == 0, f"node {node}: {out}"
        assert f"stopped at step {STEPS} ({STEPS - committed} steps this run)" in out, out
        steps = steps_of(runs[node].summary)
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), (node, steps)
        assert all(s["committed_step"] == s["step"] and s["weights_match"] for s in steps)
    assert_nodes_left_nothing(root)


def kill_in(root: Path, port: int, victim: int, fault: dict[str, Any]) -> tuple[int, str, float]:
    """Run both nodes, `fault` (a hang) on node `victim`; SIGKILL that node's daemon once its
    record shows it in the hung phase. Its job must be gone within 5 s; the survivor's exit
    code and output, and how long after the kill it exited."""
    only = {victim: {"faults": [fault]}}
    configs = node_configs(root, TINY, port, only=only, job=JOB, deadlines=DEADLINES)
    with running_nodes(configs) as runs:
        phase, step = fault["phase"], fault["step"]
        try:
            wait_for_record(port, victim, lambda r: r.step == step and phase in r.phases)
        except StoreError as exc:  # the leader left early: say why, from both nodes' output
            said = [run.wait(timeout=60) for run in runs]
            raise AssertionError(f"the job ended before {phase} of step {step}: {said}") from exc
        job = job_pids(root, victim)
        runs[victim].kill()
        killed = time.monotonic()
        assert wait_gone(job, 5.0) == [], f"node {victim}'s job outlived its daemon"
        code, out = runs[1 - victim].wait(timeout=60)
        return code, out, time.monotonic() - killed


@pytest.mark.slow
def test_a_follower_killed_mid_rollout_fails_the_leader_naming_it(runtime_dir: Path) -> None:
    port = free_port()
    code, out, seen_s = kill_in(runtime_dir, port, 1, hang("rollout", 2, "rollout", 3))
    assert code == 1, out
    assert "node 1 (ranks 2-3)" in out and "lost" in out, out
    assert seen_s < NODE_S + 10, seen_s
    assert job_pids(runtime_dir, 0) == []
    assert_resumes_from(runtime_dir, port, committed=3)


@pytest.mark.slow
def test_the_leader_killed_mid_sync_ends_every_follower(runtime_dir: Path) -> None:
    port = free_port()
    code, out, seen_s = kill_in(runtime_dir, port, 0, hang("trainer", 0, "sync", 3))
    assert code == 1, out
    assert "lost the job store" in out and f"127.0.0.1:{port}" in out, out
    assert seen_s < NODE_S + 10, seen_s
    assert job_pids(runtime_dir, 1) == []
    assert_resumes_from(runtime_dir, port, committed=3)


@pytest.mark.parametrize("program", ["run", "daemon"])
def test_a_follower_whose_leader_never_comes_exits_1_naming_it(
    runtime_dir: Path, program: str
) -> None:
    port = free_port()
    preset = TINY if program == "run" else SERVICE
    config = node_configs(runtime_dir, preset, port, job={"ranks": 4}, deadlines={"ready_s": 2.0})[
        1
    ]
    command = ["timeshare", "run"] if program == "run" else ["timeshare.daemon", "--config"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", *command, str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done
    assert f"cannot reach the job store at 127.0.0.1:{port} within 2 s" in done.stderr
    assert time.monotonic() - started < 60
    assert processes_of(node_dir(runtime_dir, 1)) == []


@pytest.mark.slow
def test_a_node_that_fails_says_why_to_the_others(runtime_dir: Path) -> None:
    """The leader's trainer raises in TRAIN: the follower fails naming node 0 and the reason
    (from the leader's last record), not a lost store: the leader left only after it."""
    root, port = runtime_dir, free_port()
    fault = {"role": "trainer", "rank": 0, "phase": "train", "kind": "raise", "step": 2}
    configs = node_configs(
        root, TINY, port, only={0: {"faults": [fault]}}, job=JOB, deadlines=DEADLINES
    )
    with running_nodes(configs) as (leader, follower):
        leader_code, leader_out = leader.wait(timeout=120)
        follower_code, follower_out = follower.wait(timeout=120)
    assert leader_code == 1 and "trainer rank 0 failed in phase train" in leader_out, leader_out
    assert follower_code == 1, follower_out
    assert "node 0 (ranks 0-1) failed" in follower_out, follower_out
    assert "lost the job store" not in follower_out, follower_out
    assert_nodes_left_nothing(root)
