"""The driver: performs what the phase machine decides ("sync decides, async acts").

It hosts the job store, spawns a trainer and a rollout worker per rank (each in its own process
group), bootstraps them from the last checkpoint, then runs each (rank, phase) the machine starts
as a command on both workers of that rank, feeding `RankFinished` back into the machine. The
machine's fences order the memory handoffs across ranks; BARRIER additionally checks that the
rank's trainer holds no device memory and meets the other ranks at a store barrier. The first
failure stops the cycle with `CycleFailed` naming rank, role and phase; on every path every
worker process group is killed and the runtime directory swept. When the job pauses, every
worker is asked what device memory it still holds: a pause that released nothing is a failure.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from timeshare.config import Config, DeadlineSection
from timeshare.daemon.workers import clean_up, prepare_runtime, record_workers, spawn
from timeshare.errors import CycleFailed, TimeshareError, WorkerFailure
from timeshare.protocols.barrier import Barrier
from timeshare.protocols.commands import WorkerId, WorkerLanes, watch_process
from timeshare.protocols.store import JobStore
from timeshare.state import (
    MEMORY_FENCES,
    Bootstrapped,
    Drained,
    Event,
    InvalidTransition,
    JobState,
    Lifecycle,
    Phase,
    RankFinished,
    Request,
    Requested,
    StepsChanged,
    advance,
    initial_state,
)

log = structlog.get_logger(__name__)

ROLES = ("trainer", "rollout")
COMMAND_POLL_S = 0.05
COMMAND_READ_S = 5.0  # a command's generation is taken before its value is written
LOG_LEVEL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PhaseRecord:
    """One rank's run of one phase: how long it took and what each worker returned."""

    step: int
    rank: int
    phase: Phase
    started: float  # time.monotonic() as the phase started
    seconds: float
    results: dict[str, Any]  # role -> the worker's result


@dataclass(frozen=True)
class BootstrapRecord:
    """One rank's workers loaded the last committed checkpoint (of `step`)."""

    step: int
    rank: int
    results: dict[str, Any]  # role -> the worker's bootstrap result


# Awaited by the driver, one record at a time per rank: it must not block the event loop.
PhaseObserver = Callable[[PhaseRecord | BootstrapRecord], Awaitable[None]]
# Called with the job's state after every transition; synchronous, so it must return at once.
StateObserver = Callable[[JobState], None]
# The deadlines in force now: a service reloads them while the cycle runs.
DeadlineSource = Callable[[], DeadlineSection]


@dataclass(frozen=True)
class CycleHooks:
    """How a front end watches and steers a running cycle (all optional)."""

    observer: PhaseObserver | None = None  # every phase that ended well
    on_state: StateObserver | None = None  # every transition
    deadlines: DeadlineSource | None = None  # else the config's, fixed
    keep_records: bool = True  # False for a service: memory must not grow with the steps
    # Commands of the job store after this generation apply to the run (None: from its start).
    commands_from: int | None = None


@dataclass
class RunSummary:
    lifecycle: str
    step: int
    reason: str | None
    cycle_seconds: float = 0.0  # from the end of bootstrap to the stop
    first_step: int = 0  # the step the checkpoint held at bootstrap
    phase_seconds: dict[str, list[float]] = field(default_factory=dict)
    records: list[PhaseRecord] = field(default_factory=list)  # in the order phases ended


@dataclass
class _Job:
    config: Config
    lanes: WorkerLanes
    store: JobStore
    barriers: list[Barrier]
    events: MemoryObjectSendStream[Event | CycleFailed]
    summary: RunSummary
    fences: frozenset[Phase]
    hooks: CycleHooks
    in_flight: int = 0
    # rank -> the samples its last ROLLOUT produced: the input of its next TRAIN
    batches: dict[int, list[Any]] = field(default_factory=dict)

    @property
    def deadlines(self) -> DeadlineSection:
        source = self.hooks.deadlines
        return self.config.deadlines if source is None else source()


async def run_cycle(
    config: Config,
    store: JobStore | None = None,
    *,
    fences: frozenset[Phase] = MEMORY_FENCES,
    hooks: CycleHooks = CycleHooks(),
) -> RunSummary:
    """Run the job until the machine stops it; raise `CycleFailed` on the first failure.

    The job store is hosted here unless the caller hosts it (`store`). `hooks` are how a front
    end watches and steers the run (`timeshare run`: an observer of finished phases; the
    service: all of them). `fences` is a test-only switch: the proof that each memory fence
    matters drops one.
    """
    runtime = Path(config.job.runtime_dir)
    await anyio.to_thread.run_sync(prepare_runtime, runtime)
    if store is None:
        store = await anyio.to_thread.run_sync(JobStore.host)
    processes: dict[WorkerId, subprocess.Popen[bytes]] = {}
    async with WorkerLanes.open(runtime, stall_timeout_s=config.deadlines.stall_s) as lanes:
        try:
            outcome = await _run_with_workers(
                config, lanes, store, processes, fences=fences, hooks=hooks
            )
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(clean_up, runtime, list(processes.values()))
    if isinstance(outcome, CycleFailed):
        raise outcome
    return outcome


async def _run_with_workers(
    config: Config,
    lanes: WorkerLanes,
    store: JobStore,
    processes: dict[WorkerId, subprocess.Popen[bytes]],
    *,
    fences: frozenset[Phase],
    hooks: CycleHooks,
) -> RunSummary | CycleFailed:
    """Spawn and watch every worker, run the cycle, shut the workers down if it ended well."""
    async with anyio.create_task_group() as watchers:
        for rank in range(config.job.ranks):
            for role in ROLES:
                worker = WorkerId(role, rank)
                lanes.expect(worker)
                processes[worker] = await spawn(config, lanes, store, worker)
                watchers.start_soon(watch_process, lanes, worker, processes[worker])
        record_workers(Path(config.job.runtime_dir), processes)
        outcome = await _drive(config, lanes, store, list(processes), fences=fences, hooks=hooks)
        if isinstance(outcome, RunSummary):
            for worker in processes:
                deadline_s = config.deadlines.for_command("shutdown")
                await lanes.call(worker, "shutdown", deadline_s=deadline_s)
        watchers.cancel_scope.cancel()
    return outcome


async def _drive(
    config: Config,
    lanes: WorkerLanes,
    store: JobStore,
    workers: list[WorkerId],
    *,
    fences: frozenset[Phase],
    hooks: CycleHooks,
) -> RunSummary | CycleFailed:
    state = initial_state(config.job.ranks, max_steps=config.job.steps, fences=fences)
    # Commands written from now on apply to this run (one written during start-up waits).
    commands_seen = hooks.commands_from
    if commands_seen is None:
        commands_seen = await anyio.to_thread.run_sync(store.add, "gen/command", 0)
    _tell(hooks, state)
    try:
        await lanes.wait_ready(workers, timeout_s=config.deadlines.ready_s)
        step = await _bootstrap(config, lanes, hooks.observer)
    except WorkerFailure as exc:
        return _failed(exc.rank, exc.role, "bootstrap", exc)
    send, receive = anyio.create_memory_object_stream[Event | CycleFailed](max_buffer_size=1000)
    barriers = await _open_barriers(config, store)
    summary = RunSummary(lifecycle=state.lifecycle.value, step=step, reason=None, first_step=step)
    cycle_started = time.monotonic()
    job = _Job(config, lanes, store, barriers, send, summary, fences, hooks)
    failure: CycleFailed | None = None
    async with anyio.create_task_group() as group, receive:
        outcome = advance(state, Bootstrapped(step))
        state = outcome.state
        _tell(hooks, state)
        await _record(store, state)
        _start(job, group, outcome.start, state.step)
        group.start_soon(_watch_commands, store, send, commands_seen, lanes, workers)
        while state.lifecycle is not Lifecycle.STOPPED:
            if state.lifecycle is Lifecycle.DRAINING and job.in_flight == 0:
                state = advance(state, Drained()).state
                _tell(hooks, state)
                continue
            event = await receive.receive()
            if isinstance(event, CycleFailed):
                failure = event
                break
            try:
                outcome = advance(state, event)
            except InvalidTransition as exc:
                if not isinstance(event, Requested | StepsChanged):
                    raise  # the driver itself broke a rule: a bug, not an input
                log.warning("cycle.command.refused", error=str(exc))
                continue
            previous, state = state, outcome.state
            _tell(hooks, state)
            _start(job, group, outcome.start, state.step)
            if state.lifecycle is Lifecycle.PAUSED and previous.lifecycle is not Lifecycle.PAUSED:
                # Every rank waits at the fence, so nothing else runs; a resume waits for this.
                failure = await _verify_released(job, workers)
                if failure is not None:
                    break
            # Job-wide moves only (a fence passed, the lifecycle changed): a store write per
            # rank and phase would put a round trip on every phase's path.
            if len(outcome.start) == config.job.ranks or state.lifecycle is not previous.lifecycle:
                await _record(store, state)
        group.cancel_scope.cancel()
    if failure is not None:
        log.error(
            "cycle.run.failed",
            rank=failure.rank,
            role=failure.role,
            phase=failure.phase,
            error=str(failure.cause),
        )
        return failure
    return await _stopped(store, state, summary, cycle_started)


async def _stopped(
    store: JobStore, state: JobState, summary: RunSummary, cycle_started: float
) -> RunSummary:
    summary.lifecycle, summary.step, summary.reason = (
        state.lifecycle.value,
        state.step,
        state.reason,
    )
    summary.cycle_seconds = time.monotonic() - cycle_started
    await _record(store, state)
    log.info("cycle.run.stopped", step=state.step, reason=state.reason)
    return summary


async def _open_barriers(config: Config, store: JobStore) -> list[Barrier]:
    # One store connection per rank: blocking waits on one connection would queue behind each other.
    connections = [
        await anyio.to_thread.run_sync(JobStore.connect, *store.address)
        for _ in range(config.job.ranks)
    ]
    return [Barrier(c, rank, config.job.ranks) for rank, c in enumerate(connections)]


async def _watch_commands(
    store: JobStore,
    events: MemoryObjectSendStream[Event | CycleFailed],
    applied: int,
    lanes: WorkerLanes,
    workers: list[WorkerId],
) -> None:
    """Feed every command written to the job store (pause, resume, drain, stop, steps) to the
    machine; pass a log level to every worker.

    Commands carry generations, so every node applies each one once, in order; one that names
    no request is logged and skipped.
    """
    while True:
        latest = await anyio.to_thread.run_sync(store.add, "gen/command", 0)
        for generation in range(applied + 1, latest + 1):
            command = await anyio.to_thread.run_sync(
                partial(store.command, generation, timeout_s=COMMAND_READ_S)
            )
            if command.get("command") == "log_level":
                await _set_workers_log_level(lanes, workers, command.get("params", {}))
                continue
            event = _command_event(command)
            if event is None:
                log.warning("cycle.command.unknown", generation=generation, command=command)
                continue
            log.info("cycle.command.received", generation=generation, command=command)
            await events.send(event)
        applied = latest
        await anyio.sleep(COMMAND_POLL_S)


def _command_event(command: dict[str, Any]) -> Event | None:
    """The machine's event for a command of the job store, or None for one it cannot name."""
    name = command.get("command")
    if name == "steps":
        steps = command.get("params", {}).get("steps")
        return StepsChanged(steps) if isinstance(steps, int) else None
    try:
        return Requested(Request(name))
    except ValueError:
        return None


async def _set_workers_log_level(
    lanes: WorkerLanes, workers: list[WorkerId], params: dict[str, Any]
) -> None:
    """Over the control lanes, answered while work runs; a worker that misses it is logged."""
    for worker in workers:
        try:
            await lanes.control(worker, "log_level", params, timeout_s=LOG_LEVEL_TIMEOUT_S)
        except TimeshareError as exc:
            log.warning("cycle.log_level.missed", worker=str(worker), error=str(exc))


def _tell(hooks: CycleHooks, state: JobState) -> None:
    if hooks.on_state is not None:
        hooks.on_state(state)


async def _verify_released(job: _Job, workers: list[WorkerId]) -> CycleFailed | None:
    """The job paused: every worker must hold no device memory, or the pause is a failure."""
    held: dict[WorkerId, float] = {}
    failure: CycleFailed | None = None

    async def ask(worker: WorkerId) -> None:
        nonlocal failure
        try:
            result = await job.lanes.call(worker, "held", {}, deadline_s=job.deadlines.phase_s)
            held[worker] = float(result["held_mb"])
        except WorkerFailure as exc:
            failure = _failed(worker.rank, worker.role, "pause", exc)

    async with anyio.create_task_group() as group:
        for worker in workers:
            group.start_soon(ask, worker)
    holding = {f"{w.role} rank {w.rank}": mb for w, mb in held.items() if mb > 0}
    if failure is None and holding:
        error = TimeshareError(f"paused, but device memory is still held (MiB): {holding}")
        worker = next(w for w, mb in held.items() if mb > 0)
        failure = _failed(worker.rank, worker.role, "pause", error)
    if failure is None:
        log.info("cycle.pause.verified", workers=len(held))
    return failure


async def _record(store: JobStore, state: JobState) -> None:
    """Write where the job stands to the job store, for every node and for operators."""
    record = {
        "lifecycle": state.lifecycle.value,
        "step": state.step,
        "phases": [p.value for p in state.phases],
        "reason": state.reason,
    }
    await anyio.to_thread.run_sync(store.put, "state", record)


async def _bootstrap(config: Config, lanes: WorkerLanes, observer: PhaseObserver | None) -> int:
    """Every worker loads the last committed checkpoint; return its step (the trainers')."""
    results: dict[WorkerId, Any] = {}
    async with anyio.create_task_group() as group:
        for rank in range(config.job.ranks):
            for role in ROLES:
                group.start_soon(_bootstrap_one, config, lanes, WorkerId(role, rank), results)
    step = min(int(result["step"]) for w, result in results.items() if w.role == "trainer")
    if observer is not None:
        for rank in range(config.job.ranks):
            by_role = {role: results[WorkerId(role, rank)] for role in ROLES}
            await observer(BootstrapRecord(step, rank, by_role))
    return step


async def _bootstrap_one(
    config: Config, lanes: WorkerLanes, worker: WorkerId, results: dict[WorkerId, Any]
) -> None:
    deadline_s = config.deadlines.for_command("bootstrap")
    results[worker] = await lanes.call(worker, "bootstrap", deadline_s=deadline_s)


def _start(job: _Job, group: TaskGroup, starts: tuple[tuple[int, Phase], ...], step: int) -> None:
    for rank, phase in starts:
        job.in_flight += 1
        group.start_soon(_run_phase, job, rank, phase, step)


async def _run_phase(job: _Job, rank: int, phase: Phase, step: int) -> None:
    """Both workers of `rank` run `phase` of `step`; the first failure is reported as CycleFailed.

    `step` is the job's step as the phase starts (TRAIN of step s makes weight version s).
    """
    started = time.monotonic()
    failure: list[CycleFailed] = []
    results: dict[str, Any] = {}

    async def call(worker: WorkerId, group: TaskGroup) -> None:
        params: dict[str, Any] = {"step": step}
        if phase is Phase.TRAIN and worker.role == "trainer":
            params["batch"] = job.batches.pop(rank, [])
        try:
            deadline_s = job.deadlines.for_command(phase.value)
            results[worker.role] = await job.lanes.call(
                worker, phase.value, params, deadline_s=deadline_s
            )
        except WorkerFailure as exc:
            exc.phase = phase.value
            failure.append(_failed(worker.rank, worker.role, phase, exc))
            group.cancel_scope.cancel()  # the other side's call would only wait for a dead peer

    async with anyio.create_task_group() as group:
        for role in ROLES:
            group.start_soon(call, WorkerId(role, rank), group)
    if not failure and phase is Phase.BARRIER:
        await _meet_at_barrier(job, rank, results, failure)
    job.in_flight -= 1
    elapsed = time.monotonic() - started
    if job.hooks.keep_records:
        job.summary.phase_seconds.setdefault(phase.value, []).append(elapsed)
    if not failure:
        if phase is Phase.ROLLOUT:
            job.batches[rank] = results["rollout"].pop("samples", [])
        record = PhaseRecord(step, rank, phase, started, elapsed, results)
        if job.hooks.keep_records:
            job.summary.records.append(record)
        if job.hooks.observer is not None:
            await job.hooks.observer(record)
    for failed in failure:
        failed.after_s = elapsed
    await job.events.send(failure[0] if failure else RankFinished(rank, phase))


async def _meet_at_barrier(
    job: _Job, rank: int, results: dict[str, Any], failure: list[CycleFailed]
) -> None:
    held = float(results["trainer"]["held_mb"])
    try:
        if held > 0:
            raise TimeshareError(f"trainer still holds {held:g} MiB of device memory at BARRIER")
        # The store barrier is how the RESUME fence holds across nodes (the machine holds it
        # within this driver); the test-only switch that drops the fence drops both.
        if Phase.RESUME in job.fences:
            await job.barriers[rank].wait("barrier", timeout_s=job.deadlines.barrier_s)
    except TimeshareError as exc:
        failure.append(_failed(rank, "trainer", Phase.BARRIER, exc))


def _failed(rank: int, role: str, phase: Phase | str, exc: BaseException) -> CycleFailed:
    name = phase.value if isinstance(phase, Phase) else phase
    failed = CycleFailed(
        f"{role} rank {rank} failed in phase {name}: {type(exc).__name__}: {exc}",
        rank=rank,
        role=role,
        phase=name,
        cause=exc,
    )
    failed.__cause__ = exc
    return failed
