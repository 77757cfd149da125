"""Running the cycle in tests, and checking that a run left nothing behind."""

from __future__ import annotations

import contextlib
import stat
import time
from pathlib import Path

import anyio
import psutil

from timeshare.config import Config
from timeshare.cycle.hooks import CycleHooks, RunSummary
from timeshare.cycle.runner import run_cycle
from timeshare.cycle.workers import WorkerSpawner, spawn_workers
from timeshare.protocols.store import JobStore
from timeshare.state import MEMORY_FENCES, Phase

RUN_TIMEOUT_S = 120


async def run(
    cfg: Config,
    store: JobStore | None = None,
    fences: frozenset[Phase] = MEMORY_FENCES,
    *,
    spawn: WorkerSpawner = spawn_workers,
    hooks: CycleHooks | None = None,
) -> RunSummary:
    with anyio.fail_after(RUN_TIMEOUT_S):
        return await run_cycle(cfg, store, fences=fences, spawn=spawn, hooks=hooks)


def processes_of(runtime_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line names the runtime dir (every worker's does)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if str(runtime_dir) in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def workers_of(runtime_dir: Path) -> list[psutil.Process]:
    """The job's worker processes (named ts-<role>-<rank>), without their zygote."""
    names = ("ts-trainer-", "ts-rollout-")
    return [p for p in processes_of(runtime_dir) if p.name().startswith(names)]


CHILDREN_GONE_S = 5.0


# The standard library's helper that any in-process use of shared memory starts once and keeps
# for the life of the test process (an earlier test on this pytest worker may have): not a
# process of any job.
RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def _children() -> list[str]:
    """This process's live children (zombies are reaped by whoever waits for them)."""
    live = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            command = " ".join(child.cmdline())
            if child.status() != psutil.STATUS_ZOMBIE and RESOURCE_TRACKER not in command:
                live.append(f"{child.pid} {command[:200]}")
    return live


def assert_nothing_left(runtime_dir: Path) -> None:
    assert processes_of(runtime_dir) == []
    # A child killed a moment ago may not be reaped yet: a few seconds, then name what is left.
    deadline = time.monotonic() + CHILDREN_GONE_S
    while (children := _children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children == [], children
    run_dir = runtime_dir / "run"
    left = [p.name for p in run_dir.iterdir()] if run_dir.exists() else []
    sockets = [n for n in left if stat.S_ISSOCK((run_dir / n).lstat().st_mode)]
    assert sockets == [] and "workers.json" not in left, left
