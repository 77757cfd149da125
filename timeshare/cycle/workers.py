"""The job's workers: the seam the cycle drives them through, and their real processes.

`Workers` is what the cycle needs of its workers (calls on their lanes, with deadlines);
`spawn_workers` is the real thing: one trainer and one rollout process per rank. Tests of the
cycle's logic pass an in-process fake instead, as httpcore's pool takes a network backend.

Workers are forked from a zygote that loaded their code once (zygote.py). Each runs in its own
session and process group, so that killing the group takes its grandchildren too. The groups
are recorded in the runtime directory (pgid and start time) so that a driver started after a
killed one reaps what it left, and never a group whose pgid an unrelated process reused. The
service manager's variables never reach a worker. Whatever way the cycle ends, every group is
killed and the runtime directory swept.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Protocol, TypeVar

import anyio
import structlog

from timeshare.cluster import node_ranks
from timeshare.config import Config
from timeshare.cycle.factory import Forked, Refused, WorkerFactory
from timeshare.durable import write_atomically
from timeshare.engines.worker import WorkerSpec
from timeshare.errors import WorkerDied, WorkerFailure, WorkersNotReady
from timeshare.protocols.commands import LaneCall, WorkerId, WorkerLanes
from timeshare.protocols.commands.params import LogLevelParams, PhaseParams
from timeshare.protocols.commands.processes import describe_exit
from timeshare.protocols.commands.results import ROLES
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import sweep_stale, weight_endpoint
from timeshare.runtime import end_groups, process_start_time, sweep_foreign_temp_dirs, wait_gone
from timeshare.torch_quiet import as_the_user_had_it

log = structlog.get_logger(__name__)

WORKERS_FILE = "workers.json"
GONE_S = 10.0  # for killed workers to exit before their staging is swept
R = TypeVar("R")
# The service manager's variables (sd_notify, watchdog, socket activation): never a worker's.
SERVICE_VARIABLES = (
    "NOTIFY_SOCKET",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)


class Workers(Protocol):
    """The job's workers as the cycle drives them: a trainer and a rollout worker per rank."""

    async def wait_ready(self, *, timeout_s: float) -> None:
        """Until every worker is up and answering; a `WorkerFailure` naming one that is not."""

    async def call(
        self,
        worker: WorkerId,
        command: str,
        params: PhaseParams | None = None,
        *,
        deadline_s: float,
        returns: type[R],
    ) -> R:
        """Run `command` on the worker; its typed result, or a `WorkerFailure` naming it."""

    async def call_all(self, calls: Sequence[LaneCall], *, deadline_s: float) -> list[object]:
        """Every call at once; their typed results in order, or the first `WorkerFailure` of
        any (the wait for the others ends). Here, one task per call: `WorkerProcesses` waits
        for them together, without a task each."""
        results: dict[int, object] = {}

        async def run(index: int, call: LaneCall) -> None:
            assert call.params is None or isinstance(call.params, PhaseParams), call.params
            results[index] = await self.call(
                call.worker, call.command, call.params, deadline_s=deadline_s, returns=call.returns
            )

        try:
            async with anyio.create_task_group() as group:
                for index, call in enumerate(calls):
                    group.start_soon(run, index, call)
        except* WorkerFailure as failures:
            raise failures.exceptions[0] from None
        return [results[index] for index in range(len(calls))]

    async def control(
        self,
        worker: WorkerId,
        command: str,
        params: LogLevelParams | None = None,
        *,
        timeout_s: float,
        returns: type[R],
    ) -> R:
        """A control command (`abort`, `log_level`, `status`), answered while work runs."""

    async def shut_down(self, *, deadline_s: float) -> None:
        """Ask every worker to exit, after a cycle that ended well."""


# What `run_cycle` starts its workers with: the job's config and store in, workers out; on
# leaving the context, nothing of them is left.
WorkerSpawner = Callable[[Config, JobStore], AbstractAsyncContextManager[Workers]]


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment is: the driver's, less the service manager's variables, and
    with torch's C++ log level as the user had it (the driver quiets its own: torch_quiet.py)."""
    env = {k: v for k, v in environ.items() if k not in SERVICE_VARIABLES}
    as_the_user_had_it(env)
    return env


def worker_ids(ranks: Iterable[int]) -> list[WorkerId]:
    return [WorkerId(role, rank) for rank in ranks for role in ROLES]


class WorkerProcesses(Workers):
    """`Workers` as real processes, reached over their command lanes."""

    def __init__(self, lanes: WorkerLanes, workers: list[WorkerId]) -> None:
        self.lanes = lanes
        self.workers = workers

    async def wait_ready(self, *, timeout_s: float) -> None:
        await self.lanes.wait_ready(self.workers, timeout_s=timeout_s)

    async def call(
        self,
        worker: WorkerId,
        command: str,
        params: PhaseParams | None = None,
        *,
        deadline_s: float,
        returns: type[R],
    ) -> R:
        return await self.lanes.call(
            worker, command, params, deadline_s=deadline_s, returns=returns
        )

    async def call_all(self, calls: Sequence[LaneCall], *, deadline_s: float) -> list[object]:
        return await self.lanes.call_all(calls, deadline_s=deadline_s)

    async def control(
        self,
        worker: WorkerId,
        command: str,
        params: LogLevelParams | None = None,
        *,
        timeout_s: float,
        returns: type[R],
    ) -> R:
        return await self.lanes.control(
            worker, command, params, timeout_s=timeout_s, returns=returns
        )

    async def shut_down(self, *, deadline_s: float) -> None:
        for worker in self.workers:
            try:
                await self.lanes.call(worker, "shutdown", deadline_s=deadline_s, returns=type(None))
            except WorkerDied as exc:
                # A worker answers shutdown once its engines have stopped, then exits at once:
                # its exit may be seen before its answer is read. A clean exit is the answer.
                if exc.returncode != 0:
                    raise


@asynccontextmanager
async def spawn_workers(config: Config, store: JobStore) -> AsyncIterator[Workers]:
    """Fork every worker process of the job from a zygote (zygote.py); kill them all and sweep
    on the way out. A worker's exit is seen the moment it happens, and ends every call on it.
    Workers are asked for, not waited for: `wait_ready` waits, under `[deadlines].ready_s`.
    """
    runtime = Path(config.job.runtime_dir)
    await anyio.to_thread.run_sync(prepare_runtime, runtime)
    env = worker_environment(os.environ)
    factory = await anyio.to_thread.run_sync(WorkerFactory.start, runtime, env)
    pids: dict[WorkerId, int] = {}
    try:
        await anyio.to_thread.run_sync(record_workers, runtime, [factory.pid])
        async with (
            WorkerLanes.open(runtime, stall_timeout_s=config.deadlines.stall_s) as lanes,
            anyio.create_task_group() as watcher,
        ):
            ranks = node_ranks(config.cluster, config.job.ranks)
            asked = dict(enumerate(worker_ids(ranks), start=1))
            watcher.start_soon(_follow, factory, lanes, runtime, asked, pids)
            for request_id, worker in asked.items():
                lanes.expect(worker)  # before it is forked, so that its hello is not missed
                try:
                    await factory.fork(
                        request_id, worker_spec(config, worker, lanes, store.address)
                    )
                except WorkersNotReady as exc:  # the cycle fails at wait_ready, naming it
                    lanes.worker_exited(worker, 1, f"never started: {exc}")
            yield WorkerProcesses(lanes, list(asked.values()))
            watcher.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(clean_up, runtime, list(pids.values()), factory)


async def _follow(
    factory: WorkerFactory,
    lanes: WorkerLanes,
    runtime: Path,
    asked: dict[int, WorkerId],
    pids: dict[WorkerId, int],
) -> None:
    """Each worker's pid as it is forked (recorded for a later driver), each exit as it comes;
    if the zygote itself dies, its workers died with it (their parent-death signal)."""
    by_pid: dict[int, WorkerId] = {}
    async for reply in factory.replies():
        if isinstance(reply, Refused):
            log.error("driver.zygote.refused", error=reply.error)
        elif isinstance(reply, Forked):
            worker = by_pid[reply.pid] = asked[reply.request_id]
            pids[worker] = reply.pid
            log.info("driver.worker.spawned", role=worker.role, rank=worker.rank, pid=reply.pid)
            # recorded after each fork, not once at the end: a driver killed mid-spawn still
            # leaves its successor every group it must kill
            groups = [factory.pid, *pids.values()]
            await anyio.to_thread.run_sync(record_workers, runtime, groups)
        elif reply.pid in by_pid:
            lanes.worker_exited(by_pid.pop(reply.pid), reply.returncode)
    returncode = await anyio.to_thread.run_sync(factory.wait_exited)
    log.error("driver.zygote.gone", returncode=returncode)
    why = "its zygote is gone"
    if returncode is not None:
        why = f"its zygote exited with {describe_exit(returncode)}"
    exited = set(pids) - set(by_pid.values())  # forked, and reported gone
    for worker in set(asked.values()) - exited:
        lanes.worker_exited(worker, -signal.SIGKILL, why)


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
        weight_endpoint=weight_endpoint(config.job.runtime_dir, worker.rank),
        store_host=host,
        store_port=port,
        checkpoint_dir=f"{config.job.checkpoint_dir}/rank{worker.rank}",
        runtime_dir=config.job.runtime_dir,
        transfer=config.transfer,
        engine=config.engine,
        checks=config.checks,
        faults=config.faults,
        collective_timeout_s=config.deadlines.phase_s,
        # within SYNC's own deadline, so that the worker, not the driver, names the call
        engine_call_timeout_s=0.9 * config.deadlines.for_command("sync"),
        generate_timeout_s=0.9 * config.deadlines.for_command("rollout"),
        log_file=config.log.file,
        log_level=config.log.level,
        log_max_mb=config.log.max_mb,
        log_keep=config.log.keep,
        resume_on_fewer_ranks=config.cluster.min_nodes > 0,
        keep_checkpoints=config.job.keep_checkpoints,
        run_dir=str(config.log.run_dir(config.job.checkpoint_dir)),
        samples_per_step=config.log.samples_per_step,
    )


def record_workers(runtime: Path, groups: list[int]) -> None:
    """Write the job's process groups (the zygote's, each worker's) for a restarted driver."""
    entries = [{"pgid": pgid, "start": process_start_time(pgid)} for pgid in groups]
    write_atomically(runtime / WORKERS_FILE, json.dumps(entries).encode())


def clean_up(runtime: Path, workers: list[int], factory: WorkerFactory) -> None:
    """Kill every worker process group, let the zygote reap them and exit, sweep the runtime dir."""
    end_groups(workers)
    factory.close()
    # A worker orphaned by a dead zygote is reaped by whoever adopted it, maybe late: its
    # staging is stale once it has exited, reaped or not.
    left = wait_gone(workers, GONE_S)
    if left:
        log.error("driver.workers.survived", pids=left)
    (runtime / WORKERS_FILE).unlink(missing_ok=True)
    sweep_stale(runtime, owners_gone=not left)


def prepare_runtime(runtime: Path) -> list[int]:
    """Make the runtime dir; kill the worker groups a killed predecessor recorded; sweep it."""
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    killed: list[int] = []
    record = runtime / WORKERS_FILE
    if record.exists():
        for entry in json.loads(record.read_text()):
            pgid = int(entry["pgid"])
            if entry.get("start") is not None and process_start_time(pgid) == entry["start"]:
                killed.append(pgid)
        end_groups(killed)
        record.unlink()
    sweep_stale(runtime)
    # and what engines of any run left in the system's temporary directory, their records
    # gone with a runtime dir deleted after a SIGKILL
    gone = sweep_foreign_temp_dirs()
    if gone:
        log.info("driver.leftovers.swept", temporary_dirs=gone)
    if killed:
        log.warning("driver.leftovers.reaped", process_groups=killed)
    return killed
