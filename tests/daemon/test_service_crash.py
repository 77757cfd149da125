"""The service end to end with the reference engine: operated, killed with SIGKILL, restarted."""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.configs import TINY, toml_file
from tests.cycle.jobs import processes_of, workers_of
from tests.daemon.daemons import Daemon, assert_daemon_left_nothing, reap, spawn_daemon
from tests.protocols.weights.peers import wait_until
from timeshare.daemon.records import read_journal, read_progress
from timeshare.runtime import wait_gone

pytestmark = pytest.mark.slow


def tiny_service_config(root: Path, steps: int, **sections: Any) -> Path:
    """The reference engine behind a daemon, logging to log.jsonl in its state directory."""
    return toml_file(
        root,
        TINY,
        "timeshared.toml",
        job={"steps": steps},
        daemon={"metrics_port": 0, "drain_s": 60.0},
        log={"file": "log.jsonl"},
        **sections,
    )


def kill_mid_cycle(daemon: Daemon, after_committed: int) -> list[int]:
    """SIGKILL the daemon once `after_committed` is committed; return the pids of its job's
    processes (the workers and their zygote)."""
    daemon.wait_for(
        lambda s: s["lifecycle"] == "running" and (s["committed_step"] or 0) >= after_committed,
        timeout=120,
    )
    assert len(workers_of(daemon.root)) == 4
    job = [p.pid for p in processes_of(daemon.root) if p.pid != daemon.process.pid]
    os.kill(daemon.process.pid, signal.SIGKILL)
    daemon.process.wait(timeout=10)
    return job


def test_operated_killed_and_resumed_from_the_committed_step(runtime_dir: Path) -> None:
    # Steps enough never to end on their own: on a loaded machine a few hundred tiny steps ran
    # out before the operator's pause (a timesharectl process) arrived.
    config = tiny_service_config(runtime_dir, steps=100_000)
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
        # No process of the job outlives its daemon by more than a few seconds, with no new
        # daemon to reap it: the zygote sees its request pipe close and kills every worker
        # group; a worker dies with the zygote (parent-death signal).
        assert wait_gone(orphans, 5.0) == []
    finally:
        reap_if_alive(first)
    killed_at = max(e["step"] for e in committed(runtime_dir))
    first_bootstraps = len(bootstraps(runtime_dir))

    second = spawn_daemon(runtime_dir, config)  # the same socket path, state and checkpoints
    try:
        status = second.wait_for(lambda s: s["lifecycle"] == "running", timeout=120)
        # What the killed daemon left is reaped: its workers, its staging, its socket file.
        assert not any(psutil.pid_exists(pid) and _alive(pid) for pid in orphans)
        assert status["pid"] == second.process.pid
        # The journal is written as it comes, off the event loop: "running" may be told first.
        second.wait_for(lambda s: len(bootstraps(runtime_dir)) > first_bootstraps, timeout=30)
        bootstrapped = bootstraps(runtime_dir)
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


def hung_in(phase: str, step: int, status: dict[str, Any]) -> bool:
    return bool(status["step"] == step and phase in status["phases"])


def journaled_commit(root: Path, step: int) -> bool:
    return step in [e["step"] for e in committed(root)]


def bootstraps(root: Path) -> list[int]:
    """The step each bootstrap of the job started from, as journaled."""
    return [e["step"] for e in read_journal(root / "state") if e["kind"] == "bootstrapped"]


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


# (role, phase, step) a daemon hangs in and is SIGKILLed there, and the step its successor
# resumes at: TRAIN of step 6 was never committed, so the next daemon starts again from 5; in
# every other phase the step's TRAIN was committed, so it resumes at that step.
KILLS = [
    ("trainer", "offload", 2, 2),
    ("trainer", "barrier", 3, 3),
    ("rollout", "resume", 4, 4),
    ("trainer", "train", 6, 5),
    ("trainer", "sync", 7, 7),  # weights mid-transfer: staging live
    ("rollout", "rollout", 8, 8),  # engines awake, KV cache held
]


def test_killed_in_every_phase_one_daemon_after_another(runtime_dir: Path) -> None:
    """Six daemons in turn hang in a phase and are SIGKILLed there; a seventh finishes."""
    for role, phase, step, resumes_at in KILLS:
        hang = {"role": role, "rank": 1, "phase": phase, "kind": "hang", "step": step}
        config = tiny_service_config(runtime_dir, steps=9, faults=[hang])
        daemon = spawn_daemon(runtime_dir, config)
        try:
            # The fault hangs rank 1 there for good: the daemon is killed while in the phase,
            # once its journal holds the commit its successor resumes from (the journal is
            # written behind the cycle: what a SIGKILL cuts short is not the test's point).
            daemon.wait_for(partial(hung_in, phase, step), timeout=120)
            assert wait_until(partial(journaled_commit, runtime_dir, resumes_at), timeout=60)
            orphans = [p.pid for p in processes_of(runtime_dir) if p.pid != daemon.process.pid]
            os.kill(daemon.process.pid, signal.SIGKILL)
            daemon.process.wait(timeout=10)
        finally:
            reap_if_alive(daemon)

    last = spawn_daemon(runtime_dir, tiny_service_config(runtime_dir, steps=9))
    try:
        done = last.wait_for(lambda s: s["lifecycle"] == "idle", timeout=120)
        assert not any(_alive(pid) for pid in orphans)  # the last one's workers were reaped
        assert done["committed_step"] == 9 and done["weight_version"] == 9
        assert done["reason"] == "completed 9 steps"
        assert last.stop() == 0
    finally:
        reap(last)
    journal = read_journal(runtime_dir / "state")
    resumed = [e["step"] for e in journal if e["kind"] == "bootstrapped"]
    assert resumed == [0] + [resumes_at for *_, resumes_at in KILLS]
    assert [e["step"] for e in committed(runtime_dir)] == list(range(1, 10))  # each once
    versions = [e["version"] for e in journal if e["kind"] == "weights.synced"]
    assert versions == sorted(versions) and versions[-1] == 9
    assert_daemon_left_nothing(runtime_dir)
