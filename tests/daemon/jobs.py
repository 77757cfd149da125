"""Running the driver in tests, and checking that a run left nothing behind."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import anyio
import msgspec
import psutil

from timeshare.config import Config
from timeshare.daemon.driver import RunSummary, run_cycle
from timeshare.protocols.store import JobStore
from timeshare.state import MEMORY_FENCES, Phase


def config(runtime_dir: Path, **sections: dict[str, Any] | list[Any]) -> Config:
    """A small, fast job in `runtime_dir`; `sections` override whole keys of each section."""
    data: dict[str, Any] = {
        "job": {
            "runtime_dir": str(runtime_dir / "run"),
            "checkpoint_dir": str(runtime_dir / "checkpoints"),
            "ranks": 1,
            "steps": 1,
        },
        "deadlines": {"phase_s": 12.0, "stall_s": 1.5, "barrier_s": 10.0},
        "transfer": {"bucket_mb": 1.0, "ack_timeout_s": 10.0},
    }
    for name, value in sections.items():
        data[name] = {**data.get(name, {}), **value} if isinstance(value, dict) else value
    return msgspec.convert(data, Config)


async def run(
    cfg: Config, store: JobStore | None = None, fences: frozenset[Phase] = MEMORY_FENCES
) -> RunSummary:
    with anyio.fail_after(120):
        return await run_cycle(cfg, store, fences=fences)


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
