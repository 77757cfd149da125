"""The driver with real worker processes: a clean run, and the fault matrix.

Every phase x {raise, hang, SIGKILL} x {trainer, rollout} must end in CycleFailed naming rank,
role and phase, within the configured deadline (+2 s), with no process, staging or socket left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import pytest

from tests.daemon.jobs import assert_nothing_left, config, processes_of, run
from tests.protocols.weights.peers import wait_until
from timeshare.config import DeadlineSection
from timeshare.daemon.driver import _verify_released
from timeshare.daemon.workers import prepare_runtime
from timeshare.errors import CycleFailed, WorkerDied, WorkerError, WorkerStalled
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.store import JobStore
from timeshare.runtime import process_start_time
from timeshare.state import Phase

STALL_S = 1.5
CAUSES = {"raise": WorkerError, "kill": WorkerDied, "hang": WorkerStalled}


@pytest.mark.asyncio
async def test_a_clean_run_of_two_ranks(runtime_dir: Path) -> None:
    store = JobStore.host()
    summary = await run(config(runtime_dir, job={"ranks": 2, "steps": 2}), store)
    assert (summary.lifecycle, summary.step, summary.reason) == ("stopped", 2, "completed 2 steps")
    recorded = store.get("state", timeout_s=5.0)
    assert recorded == {
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
@pytest.mark.parametrize("kind", ["raise", "hang", "kill"])
@pytest.mark.parametrize("role", ["trainer", "rollout"])
@pytest.mark.parametrize("phase", [p.value for p in Phase])
async def test_fault_matrix(runtime_dir: Path, phase: str, role: str, kind: str) -> None:
    cfg = config(runtime_dir, faults=[{"role": role, "rank": 0, "phase": phase, "kind": kind}])
    with pytest.raises(CycleFailed) as info:
        await run(cfg)
    failed = info.value
    assert (failed.rank, failed.role, failed.phase) == (0, role, phase)
    assert f"{role} rank 0 failed in phase {phase}" in str(failed)
    assert isinstance(failed.cause, CAUSES[kind])
    if kind == "raise":
        assert isinstance(failed.cause, WorkerError)
        assert failed.cause.remote_type == "SimulatedFault"
    deadline = STALL_S if kind == "hang" else 0.0
    assert failed.after_s is not None and failed.after_s < deadline + 2.0
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


class _HeldLanes:
    """The lanes as `_verify_released` sees them: each worker says what it holds."""

    def __init__(self, held: dict[str, float]) -> None:
        self.held = held

    async def call(self, worker: WorkerId, command: str, params: Any, *, deadline_s: float) -> Any:
        assert command == "held" and deadline_s > 0
        return {"held_mb": self.held[f"{worker.role}{worker.rank}"]}


@pytest.mark.parametrize(
    ("held", "failed_role"),
    [
        ({"trainer0": 0.0, "rollout0": 0.0, "trainer1": 0.0, "rollout1": 0.0}, None),
        ({"trainer0": 0.0, "rollout0": 0.0, "trainer1": 0.0, "rollout1": 512.0}, "rollout"),
        ({"trainer0": 64.0, "rollout0": 0.0, "trainer1": 0.0, "rollout1": 0.0}, "trainer"),
    ],
)
def test_a_pause_that_released_nothing_is_a_failure(
    held: dict[str, float], failed_role: str | None
) -> None:
    job = SimpleNamespace(lanes=_HeldLanes(held), deadlines=DeadlineSection())
    workers = [WorkerId(role, rank) for rank in (0, 1) for role in ("trainer", "rollout")]
    failure = anyio.run(_verify_released, cast(Any, job), workers)
    if failed_role is None:
        assert failure is None
    else:
        assert failure is not None and failure.role == failed_role and failure.phase == "pause"
        assert "still held" in str(failure)
