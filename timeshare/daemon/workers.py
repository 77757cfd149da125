"""Worker processes of a job: spawning, recording, reaping, cleaning up.

Each worker runs in its own session and process group, so that killing the group takes its
grandchildren too. The groups are recorded in the runtime directory (pgid and start time) so
that a driver started after a killed one reaps what it left, and never a group whose pgid an
unrelated process reused. The service manager's variables never reach a worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import anyio
import msgspec
import structlog

from timeshare.config import Config
from timeshare.engines.worker import WorkerSpec
from timeshare.protocols.commands import WorkerId, WorkerLanes
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import sweep_stale
from timeshare.runtime import process_start_time

log = structlog.get_logger(__name__)

WORKERS_FILE = "workers.json"
# Variables of the service manager that must not reach workers.
PRIVATE_ENV = (
    "NOTIFY_SOCKET",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)


def worker_spec(
    config: Config, worker: WorkerId, lanes: WorkerLanes, store_address: tuple[str, int]
) -> WorkerSpec:
    """What a worker process is told: its part of the config, its endpoints, the job store."""
    host, port = store_address
    return WorkerSpec(
        role="trainer" if worker.role == "trainer" else "rollout",
        rank=worker.rank,
        world_size=config.job.ranks,
        work_endpoint=lanes.work_endpoint,
        control_endpoint=lanes.control_endpoint,
        weight_endpoint=f"ipc://{config.job.runtime_dir}/w-rank{worker.rank}.sock",
        store_host=host,
        store_port=port,
        checkpoint_dir=f"{config.job.checkpoint_dir}/rank{worker.rank}",
        transfer=config.transfer,
        engine=config.engine,
        faults=config.faults,
        collective_timeout_s=config.deadlines.phase_s,
        log_file=config.log.file,
        log_level=config.log.level,
    )


async def spawn(
    config: Config, lanes: WorkerLanes, store: JobStore, worker: WorkerId
) -> subprocess.Popen[bytes]:
    spec = worker_spec(config, worker, lanes, store.address)
    argv = [sys.executable, "-m", "timeshare.engines.worker", msgspec.json.encode(spec).decode()]
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    # Own session and process group: a kill of the group takes grandchildren too.
    process = await anyio.to_thread.run_sync(
        lambda: subprocess.Popen(argv, env=env, start_new_session=True)
    )
    log.info("driver.worker.spawned", role=worker.role, rank=worker.rank, pid=process.pid)
    return process


def record_workers(runtime: Path, processes: dict[WorkerId, subprocess.Popen[bytes]]) -> None:
    """Write the worker process groups so that a restarted driver can reap them."""
    entries = [{"pgid": p.pid, "start": process_start_time(p.pid)} for p in processes.values()]
    temporary = runtime / f"{WORKERS_FILE}.tmp"
    temporary.write_text(json.dumps(entries))
    temporary.replace(runtime / WORKERS_FILE)


def clean_up(runtime: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    """Kill every worker process group, then remove what the job left in the runtime dir."""
    for process in processes:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
    (runtime / WORKERS_FILE).unlink(missing_ok=True)
    sweep_stale(runtime)


def prepare_runtime(runtime: Path) -> list[int]:
    """Make the runtime dir; kill the worker groups a killed predecessor recorded; sweep it."""
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    killed: list[int] = []
    record = runtime / WORKERS_FILE
    if record.exists():
        for entry in json.loads(record.read_text()):
            pgid = int(entry["pgid"])
            if entry.get("start") is not None and process_start_time(pgid) == entry["start"]:
                with suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                    killed.append(pgid)
        record.unlink()
    sweep_stale(runtime)
    if killed:
        log.warning("driver.leftovers.reaped", process_groups=killed)
    return killed
