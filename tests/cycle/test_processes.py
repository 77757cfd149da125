"""The cycle with real worker processes: a clean run, each fault class end to end, reaping.

Each fault class (raise, hang, SIGKILL) is proven once per role with real processes, each in a
different phase; test_runner.py drives the whole matrix against in-process fakes. A failure
ends in CycleFailed naming rank, role and phase, promptly (a hang by the stall rule, before the
phase's deadline), with no process, staging or socket left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.configs import config
from tests.cycle.jobs import assert_nothing_left, processes_of, run
from tests.protocols.weights.peers import wait_until
from timeshare.cycle.workers import prepare_runtime
from timeshare.errors import CycleFailed, WorkerDied, WorkerError, WorkerStalled
from timeshare.protocols.store import JobStore, state_key
from timeshare.runtime import process_start_time

CAUSES = {"raise": WorkerError, "kill": WorkerDied, "hang": WorkerStalled}
# (role, phase, kind): every kind for every role once, and every phase once.
FAULTS = [
    ("trainer", "offload", "raise"),
    ("rollout", "resume", "raise"),
    ("trainer", "barrier", "hang"),
    ("rollout", "rollout", "hang"),
    ("trainer", "sync", "kill"),
    ("rollout", "train", "kill"),
]


@pytest.mark.asyncio
async def test_a_clean_run_of_two_ranks(runtime_dir: Path) -> None:
    store = JobStore.host()
    summary = await run(config(runtime_dir, job={"ranks": 2, "steps": 2}), store)
    assert (summary.lifecycle, summary.step, summary.reason) == ("stopped", 2, "completed 2 steps")
    recorded = store.get(state_key(0), timeout_s=5.0)
    assert recorded == {
        "node": 0,
        "lifecycle": "stopped",
        "step": 2,
        "phases": ["rollout", "rollout"],
        "reason": "completed 2 steps",
    }
    # Bootstrap enters at SYNC: two steps are 3 SYNCs and 2 TRAINs per rank.
    assert len(summary.phase_seconds["sync"]) == 2 * 3
    assert len(summary.phase_seconds["train"]) == 2 * 2
    assert_nothing_left(runtime_dir)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(("role", "phase", "kind"), FAULTS, ids=["-".join(f) for f in FAULTS])
async def test_each_fault_class_ends_the_run_naming_where(
    runtime_dir: Path, role: str, phase: str, kind: str
) -> None:
    log_file = runtime_dir / "log.jsonl"
    cfg = config(
        runtime_dir,
        faults=[{"role": role, "rank": 0, "phase": phase, "kind": kind}],
        log={"file": str(log_file)},
    )
    with pytest.raises(CycleFailed) as info:
        await run(cfg)
    failed = info.value
    assert (failed.rank, failed.role, failed.phase) == (0, role, phase)
    assert f"{role} rank 0 failed in phase {phase}" in str(failed)
    assert isinstance(failed.cause, CAUSES[kind])
    if isinstance(failed.cause, WorkerError):
        assert failed.cause.remote_type == "SimulatedFault"
    # A hang ends by the stall rule (WorkerStalled), before the phase's deadline would end it
    # (CommandTimeout); how long after stall_s depends on how long the worker waited for a CPU,
    # which the rule leaves out of its idleness on purpose: test_commands.py bounds that against
    # the worker's own CPU wait. (A clean clone's make test saw 3.56 s here, 1.5 s stall_s.)
    bound = cfg.deadlines.phase_s if kind == "hang" else 2.0
    assert failed.after_s is not None and failed.after_s < bound
    if kind == "hang":  # the stalled call was aborted where it hung, and said so in its log
        events = [json.loads(line) for line in log_file.read_text().splitlines()]
        aborted = [e for e in events if e["event"] == "worker.call.aborted"]
        assert [(e["role"], e["command"]) for e in aborted] == [(role, phase)]
    assert_nothing_left(runtime_dir)


def test_a_restarted_driver_reaps_what_a_killed_one_left(runtime_dir: Path) -> None:
    run_dir = runtime_dir / "run"
    run_dir.mkdir()
    # A worker of a killed predecessor: its own process group, with a grandchild. Both carry
    # the run dir in their command line, as real workers do.
    sleeper = f"import time; time.sleep(600)  # {run_dir}"
    spawn = f"subprocess.Popen([sys.executable, '-c', {sleeper!r}])"
    parent = f"import subprocess, sys; {spawn}; {sleeper}"
    orphan = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    entry = {"pgid": orphan.pid, "start": process_start_time(orphan.pid)}
    (run_dir / "workers.json").write_text(json.dumps([entry]))
    assert wait_until(lambda: len(processes_of(run_dir)) == 2)
    assert prepare_runtime(run_dir) == [orphan.pid]
    orphan.wait(timeout=10)
    assert wait_until(lambda: processes_of(run_dir) == [])
    assert_nothing_left(runtime_dir)


def test_reaping_leaves_a_reused_process_group_alone(runtime_dir: Path) -> None:
    run_dir = runtime_dir / "run"
    run_dir.mkdir()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    bystander = subprocess.Popen(sleep, start_new_session=True)
    # Recorded with another start time: the pgid was reused by an unrelated process.
    (run_dir / "workers.json").write_text(json.dumps([{"pgid": bystander.pid, "start": 1}]))
    try:
        assert prepare_runtime(run_dir) == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=10)
