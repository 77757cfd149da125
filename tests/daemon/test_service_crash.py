"""The service end to end with the reference engine: operated, killed with SIGKILL, restarted."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.daemon.daemons import Daemon, assert_daemon_left_nothing, reap, spawn_daemon
from tests.daemon.jobs import processes_of
from tests.daemon.test_run import TINY
from timeshare.daemon.records import read_journal, read_progress

pytestmark = pytest.mark.slow

DAEMON = """
[daemon]
state_dir = "{root}/state"
metrics_port = 0
drain_s = 60.0
"""


def tiny_service_config(root: Path, steps: int, extra: str = "") -> Path:
    path = root / "timeshared.toml"
    text = TINY.format(root=root, steps=steps, extra=DAEMON.format(root=root) + extra)
    path.write_text(text.replace(f'file = "{root}/log.jsonl"', 'file = "log.jsonl"'))
    return path


def kill_mid_cycle(daemon: Daemon, after_committed: int) -> list[int]:
    """SIGKILL the daemon once `after_committed` is committed; return its workers' pids."""
    daemon.wait_for(
        lambda s: s["lifecycle"] == "running" and (s["committed_step"] or 0) >= after_committed,
        timeout=120,
    )
    workers = [p.pid for p in processes_of(daemon.root) if p.pid != daemon.process.pid]
    assert len(workers) == 4
    os.kill(daemon.process.pid, signal.SIGKILL)
    daemon.process.wait(timeout=10)
    return workers


def test_operated_killed_and_resumed_from_the_committed_step(runtime_dir: Path) -> None:
    config = tiny_service_config(runtime_dir, steps=400)
    first = spawn_daemon(runtime_dir, config)
    try:
        first.wait_for(lambda s: (s["committed_step"] or 0) >= 1, timeout=120)
        assert first.ctl("status").returncode == 0
        paused = first.ctl("pause", "--wait")
        assert paused.returncode == 0, paused.stderr
        held = first.wait_for(lambda s: s["lifecycle"] == "paused")
        assert held["committed_step"] == held["step"] == held["weight_version"]
        assert first.ctl("resume").returncode == 0
        orphans = kill_mid_cycle(first, after_committed=held["step"] + 2)
    finally:
        reap_if_alive(first)
    killed_at = max(e["step"] for e in committed(runtime_dir))

    second = spawn_daemon(runtime_dir, config)  # the same socket path, state and checkpoints
    try:
        status = second.wait_for(lambda s: s["lifecycle"] == "running", timeout=120)
        # What the killed daemon left is reaped: its workers, its staging, its socket file.
        assert not any(psutil.pid_exists(pid) and _alive(pid) for pid in orphans)
        assert status["pid"] == second.process.pid
        bootstrapped = [
            e["step"] for e in read_journal(runtime_dir / "state") if e["kind"] == "bootstrapped"
        ]
        assert bootstrapped[-1] >= killed_at  # resumed from the last committed step
        second.wait_for(lambda s: (s["committed_step"] or 0) >= bootstrapped[-1] + 2, timeout=120)
        drained = second.ctl("drain", "--wait")
        assert drained.returncode == 0, drained.stderr
        idle = second.status()
        assert idle["lifecycle"] == "idle"
        assert read_progress(runtime_dir / "state")["committed_step"] == idle["committed_step"]
        assert second.ctl("stop").returncode == 0
        assert second.process.wait(timeout=60) == 0
    finally:
        reap(second)

    journal = read_journal(runtime_dir / "state")
    steps = [e["step"] for e in committed(runtime_dir)]
    assert steps == sorted(set(steps)), steps  # no committed step twice
    versions = [e["version"] for e in journal if e["kind"] == "weights.synced"]
    assert versions == sorted(versions)  # weight versions only grow (a restart re-sends its own)
    assert_daemon_left_nothing(runtime_dir)


def committed(root: Path) -> list[dict[str, int]]:
    return [e for e in read_journal(root / "state") if e["kind"] == "step.committed"]


def reap_if_alive(daemon: Daemon) -> None:
    if daemon.process.poll() is None:
        reap(daemon)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize(
    ("role", "phase", "resumes_at"),
    [
        ("trainer", "train", 2),  # step 3 was never committed: it runs again, from step 2
        ("trainer", "sync", 3),  # committed, weights mid-transfer (staging live)
        ("rollout", "rollout", 3),  # engines awake, KV cache held
    ],
)
def test_killed_in_a_phase_and_restarted(
    runtime_dir: Path, role: str, phase: str, resumes_at: int
) -> None:
    hang = f'[[faults]]\nrole = "{role}"\nrank = 0\nphase = "{phase}"\nkind = "hang"\nstep = 3\n'
    first = spawn_daemon(runtime_dir, tiny_service_config(runtime_dir, steps=5, extra=hang))
    try:
        first.wait_for(lambda s: s["step"] == 3 and phase in s["phases"], timeout=120)
        time.sleep(0.5)  # in the phase, hung there
        assert phase in first.status()["phases"]
        orphans = [p.pid for p in processes_of(runtime_dir) if p.pid != first.process.pid]
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(timeout=10)
    finally:
        reap_if_alive(first)

    second = spawn_daemon(runtime_dir, tiny_service_config(runtime_dir, steps=5))
    try:
        done = second.wait_for(lambda s: s["lifecycle"] == "idle", timeout=120)
        assert not any(_alive(pid) for pid in orphans)
        assert done["committed_step"] == 5 and done["reason"] == "completed 5 steps"
        assert second.stop() == 0
    finally:
        reap(second)
    journal = read_journal(runtime_dir / "state")
    assert [e["step"] for e in journal if e["kind"] == "bootstrapped"] == [0, resumes_at]
    steps = [e["step"] for e in committed(runtime_dir)]
    assert steps == [1, 2, 3, 4, 5]  # each once, across both daemons
    versions = [e["version"] for e in journal if e["kind"] == "weights.synced"]
    assert versions == sorted(versions) and versions[-1] == 5
    assert_daemon_left_nothing(runtime_dir)
