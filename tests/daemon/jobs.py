"""Running the driver in tests, and checking that a run left nothing behind."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import anyio
import psutil

from timeshare.daemon.driver import DriverConfig, RunSummary, run_cycle
from timeshare.protocols.store import JobStore


def config(runtime_dir: Path, **overrides: Any) -> DriverConfig:
    fields: dict[str, Any] = {
        "runtime_dir": str(runtime_dir / "run"),
        "checkpoint_dir": str(runtime_dir / "checkpoints"),
        "ranks": 1,
        "steps": 1,
        "phase_deadline_s": 10.0,
        "stall_timeout_s": 1.5,
        "barrier_timeout_s": 10.0,
        **overrides,
    }
    return DriverConfig(**fields)


async def run(cfg: DriverConfig, store: JobStore | None = None) -> RunSummary:
    with anyio.fail_after(120):
        return await run_cycle(cfg, store)


def processes_of(runtime_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line names the runtime dir (every worker's does)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if str(runtime_dir) in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def assert_nothing_left(runtime_dir: Path) -> None:
    assert processes_of(runtime_dir) == []
    assert psutil.Process().children(recursive=True) == []
    run_dir = runtime_dir / "run"
    left = [p.name for p in run_dir.iterdir()] if run_dir.exists() else []
    sockets = [n for n in left if stat.S_ISSOCK((run_dir / n).lstat().st_mode)]
    assert sockets == [] and "workers.json" not in left, left
