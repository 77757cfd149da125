"""The service: one job's cycle under an operator's control, for as long as the daemon runs.

`timeshared` is this plus its fronts (control socket, systemd, metrics) and the operator's
requests (requests.py); `timeshare run` runs the same cycle without it. What the service is
doing is its lifecycle table's (state/service.py); this performs it: runs a cycle when one is
wanted, follows it, and keeps everything it learns for `status`, streamed to watchers, appended
to the journal, sent to systemd and to the metrics.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from timeshare.cluster import node_ranks
from timeshare.config import Config, LoadedConfig
from timeshare.cycle.commands import IDLE_START, READ_S
from timeshare.cycle.hooks import BootstrapReport, CycleHooks, PhaseReport
from timeshare.cycle.runner import run_cycle
from timeshare.cycle.workers import WorkerSpawner, spawn_workers
from timeshare.daemon.health import LoopLag, watchdog_fed
from timeshare.daemon.metrics import Metrics
from timeshare.daemon.progress import JobProgress, SavedProgress
from timeshare.daemon.records import RecordWriter, journal_entry
from timeshare.daemon.systemd import Notifier
from timeshare.daemon.watchers import Watchers
from timeshare.errors import CycleFailed, StoreError
from timeshare.protocols.control import ServiceStatus
from timeshare.protocols.nodes import NodeSeen
from timeshare.protocols.store import AsyncJobStore, heard_key
from timeshare.report.scalars import ScalarWriter
from timeshare.report.trace import TraceFile
from timeshare.state import JobState
from timeshare.state.service import (
    FINAL,
    CycleEnded,
    CycleWanted,
    JobMoved,
    ServiceEvent,
    ServiceLifecycle,
    StopRequested,
    advance_service,
)

log = structlog.get_logger(__name__)

# What a daemon idle on one node of several hears from the others (`watch_idle_nodes`); a
# running cycle's command feed skips START (cycle/commands.py, which names it).
START, STOP = IDLE_START, "stop"
IDLE_POLL_S = 0.25
# How long the leader's daemon, which hosts the job store, stays after telling idle nodes to
# stop, until each has read it: gone at once, it took the store with it before a node that
# polls every IDLE_POLL_S (slower on a loaded machine) had read the stop, and that node idled
# on. Ample for a node that is there; a node that is down costs this much on the way out.
STOP_HEARD_S = 15.0
S = ServiceLifecycle


@dataclass(frozen=True)
class ServicePaths:
    config_file: Path
    state_dir: Path
    socket: Path


@dataclass(frozen=True)
class ServiceParts:
    """What the daemon built for the service: its fronts and the job store it hosts."""

    notifier: Notifier
    metrics: Metrics
    store: AsyncJobStore
    metrics_port: int | None = None
    activated: bool = False  # started by socket activation: idle until `resume`
    spawn: WorkerSpawner = spawn_workers  # the workers' processes (a test passes a fake)
    scalars: ScalarWriter | None = None  # [log].tensorboard: every step's scalars
    trace: TraceFile | None = None  # [log].trace: the timeline of every cycle


class Service:
    def __init__(
        self,
        loaded: LoadedConfig,
        config: Config,
        paths: ServicePaths,
        parts: ServiceParts,
        saved: SavedProgress,
    ) -> None:
        self.loaded = loaded  # as read: what a reload compares with
        self.config = config  # with the daemon's paths resolved
        self.paths = paths
        self.parts = parts
        ranks = node_ranks(config.cluster, config.job.ranks)
        self.progress = JobProgress(ranks, parts.metrics, saved, parts.scalars)
        self.records = RecordWriter(
            paths.state_dir, lambda: msgspec.to_builtins(self.progress.snapshot())
        )
        self.watchers = Watchers()
        self.loop_lag = LoopLag()
        self.state = S.IDLE if parts.activated else S.STARTING
        self.job: JobState | None = None  # the running cycle's machine, as last told
        self.node_records: list[NodeSeen] = []  # several nodes: each one's, as last read
        self.reason: str | None = None
        if parts.activated:
            self.reason = "socket-activated: `timesharectl resume` starts the cycle"
        self.exit_code = 0
        self._started = time.monotonic()
        self._last_progress = time.monotonic()
        self._cycle_scope: anyio.CancelScope | None = None
        self._commands_from: int | None = None  # the job store's last command before the cycle
        self._stop_told: int | None = None  # the generation of a stop told to idle nodes
        self._changed = anyio.Event()
        parts.metrics.lifecycle.state(self.state.value)

    # -- what status shows -----------------------------------------------------------------------

    def status(self) -> ServiceStatus:
        job, progress = self.job, self.progress
        return ServiceStatus(
            lifecycle=self.state.value,
            phases=[p.value for p in job.phases] if job and self.cycle_runs else [],
            step=job.step if job else progress.committed_step,
            steps=self.config.job.steps,
            committed_step=progress.committed_step,
            weight_version=progress.weight_version,
            last_step=progress.last_step,
            reason=self.reason,
            uptime_s=round(time.monotonic() - self._started, 3),
            pid=os.getpid(),
            ranks=self.config.job.ranks,
            engine="{} trainer, {} rollout".format(*self.config.engine.names),
            metrics_port=self.parts.metrics_port,
            log_level=self.config.log.level,
            loop_lag_max_ms=round(self.loop_lag.max_s * 1000, 3),
            node=self.config.cluster.node_rank,
            nodes=self._nodes() if self.cycle_runs else [],
        )

    def _nodes(self) -> list[dict[str, object]]:
        now, silent_after_s = time.monotonic(), self.config.deadlines.node_s
        return [seen.view(now, silent_after_s) for seen in self.node_records]

    @property
    def cycle_runs(self) -> bool:
        return self._cycle_scope is not None

    def healthy(self) -> bool:
        """Whether the watchdog should be fed (health.py says when)."""
        since = time.monotonic() - self._last_progress
        return watchdog_fed(self.state, self.cycle_runs, since, self.config.deadlines)

    # -- the cycle -------------------------------------------------------------------------------

    async def open(self) -> None:
        """Before any request is answered: where the job store's commands stand, so that every
        request forwarded from now on reaches the first cycle, however early it comes."""
        self._commands_from = await self.parts.store.latest_command()

    async def want_cycle(self) -> None:
        """A new cycle runs the remaining steps (`resume` while idle); requests forwarded from
        now on reach it."""
        self._commands_from = await self.parts.store.latest_command()
        self.move(CycleWanted())

    async def tell_idle_nodes(self, command: str) -> None:
        """Several nodes: `start` or `stop` given here while idle, for every other node's
        daemon that is idle too (`watch_idle_nodes`); a running cycle reads its own commands."""
        if self.config.cluster.nodes > 1:
            generation = await self.command(command)
            if command == STOP:
                self._stop_told = generation

    async def let_nodes_hear_stop(self) -> None:
        """The leader, which hosts the job store, after telling idle nodes to stop: stay until
        each has read it (`heard_key`), or STOP_HEARD_S; a node that never does is named."""
        cluster = self.config.cluster
        if self._stop_told is None or cluster.node_rank != 0:
            return
        keys = {node: heard_key(self._stop_told, node) for node in range(1, cluster.nodes)}
        unheard = list(keys)
        with anyio.move_on_after(STOP_HEARD_S):
            while unheard:
                try:
                    heard = await self.parts.store.read_present([keys[n] for n in unheard])
                except StoreError as exc:
                    log.warning("service.stop.unheard", nodes=unheard, error=str(exc))
                    return
                unheard = [node for node, seen in zip(unheard, heard, strict=True) if seen is None]
                if unheard:
                    await anyio.sleep(IDLE_POLL_S / 2)
        if unheard:
            log.warning("service.stop.unheard", nodes=unheard, waited_s=STOP_HEARD_S)

    async def watch_idle_nodes(self) -> None:
        """Several nodes: while this daemon is idle, a `start` or `stop` given on another node
        applies here too, so that one operator's request acts on the whole job. Commands
        written while a cycle ran were that cycle's to read."""
        if self.config.cluster.nodes == 1:
            return
        store, read, lost = self.parts.store, None, False
        while self.state not in FINAL:
            try:
                latest = await store.latest_command()
                if read is not None and self.state is S.IDLE:
                    for generation in range(read + 1, latest + 1):
                        await self._idle_node_command(generation)
                read, lost = latest, False
            except StoreError as exc:  # the leader's daemon is gone: said once, tried again
                if not lost:
                    log.warning("service.store.unreachable", error=str(exc))
                lost = True
            await anyio.sleep(IDLE_POLL_S)

    async def _idle_node_command(self, generation: int) -> None:
        try:
            command = await self.parts.store.command(generation, timeout_s=READ_S)
        except TimeoutError:  # its writer died between taking the generation and writing
            return
        name = None if command is None else command.command
        if self.state is not S.IDLE or name not in (START, STOP):
            return  # (pause, drain or resume given while idle change nothing anywhere)
        log.info("service.node_command.received", command=name, generation=generation)
        self.journal_add("node_command", command=name, generation=generation)
        if name == STOP:
            self.move(StopRequested())
            self.parts.notifier.stopping("stopping: stop given on another node")
            node = self.config.cluster.node_rank
            await self.parts.store.put(heard_key(generation, node), node)
        elif self.steps_left():
            await self.want_cycle()

    async def run_cycles(self) -> None:
        """Run a cycle whenever one is wanted and steps remain; idle otherwise; until final."""
        while self.state not in FINAL:
            if self.state is S.STARTING:
                if self.steps_left():
                    await self._run_cycle()
                    await self.records.flush()  # what the cycle did is on disk before idle
                else:
                    self.move(CycleEnded())
                continue
            if not self.parts.notifier.ready_sent:  # nothing to start: up and answering
                self.parts.notifier.ready(self.status_line())
            await self.wait_changed()

    def steps_left(self) -> bool:
        committed = self.progress.committed_step
        return committed is None or committed < self.config.job.steps

    async def _run_cycle(self) -> None:
        self.reason = None
        hooks = CycleHooks(
            observer=self._observe,
            on_state=self._on_state,
            deadlines=lambda: self.config.deadlines,
            keep_reports=False,
            commands_from=self._commands_from,
            on_nodes=self._on_nodes,
            on_record=None if self.parts.trace is None else self.parts.trace.add,
        )
        failed = False
        try:
            with anyio.CancelScope() as scope:
                self._cycle_scope = scope
                store, spawn = self.parts.store.blocking, self.parts.spawn
                summary = await run_cycle(self.config, store, hooks=hooks, spawn=spawn)
                self.reason = summary.reason
                self.journal_add("cycle.stopped", step=summary.step, reason=summary.reason)
                if summary.stop_requested and self.state not in FINAL:
                    self.move(StopRequested())  # given on another node: this daemon stops too
            if scope.cancelled_caught:
                self._drain_overdue()
        except CycleFailed as exc:
            self._cycle_failed(exc)
            failed = True
        finally:
            self._cycle_scope = None
            self.progress.cycle_ended()
        self.move(CycleEnded(failed=failed))

    def _drain_overdue(self) -> None:
        self.reason = f"drain took longer than {self.config.daemon.drain_s:g} s"
        self.exit_code = 1
        self.journal_add("cycle.cancelled", reason=self.reason)
        log.error("service.drain.overdue", drain_s=self.config.daemon.drain_s)

    def _cycle_failed(self, failed: CycleFailed) -> None:
        kind = type(failed.cause).__name__
        self.parts.metrics.failed(kind)
        self.reason = str(failed)
        self.journal_add(
            "cycle.failed",
            rank=failed.rank,
            role=failed.role,
            phase=failed.phase,
            error_kind=kind,
            error=str(failed),
        )
        self.exit_code = 1  # systemd restarts a failed service; the restart resumes
        self.parts.notifier.stopping(f"failed: {failed}")
        log.error("service.cycle.failed", error=str(failed), kind=kind)

    def _on_state(self, state: JobState) -> None:
        """Every transition of the running cycle (synchronous: must return at once)."""
        self.job = state
        self._last_progress = time.monotonic()
        self.reason = state.reason
        self.move(JobMoved(state.lifecycle), announce=False)
        notifier = self.parts.notifier
        if not notifier.ready_sent and self.state is S.RUNNING:
            notifier.ready(self.status_line())  # workers up, checkpoint loaded
        else:
            notifier.status(self.status_line())
        entry = journal_entry(
            "transition",
            lifecycle=state.lifecycle.value,
            step=state.step,
            phases=[p.value for p in state.phases],
            reason=state.reason,
        )
        self.records.add(entry)
        self.watchers.publish(entry)
        self._wake()

    def _on_nodes(self, records: list[NodeSeen]) -> None:
        self.node_records = records

    async def _observe(self, report: PhaseReport | BootstrapReport) -> None:
        """Every phase that ended well (awaited by the driver: only in-memory work here)."""
        self._last_progress = time.monotonic()
        if isinstance(report, BootstrapReport):
            entries = self.progress.bootstrapped(report)
        else:
            entries = self.progress.phase_ended(report)
        if entries:
            self.records.add(*entries)
            self.records.progress_changed()

    # -- what operators change (daemon/requests.py decides) ---------------------------------------

    def subscribe(self) -> MemoryObjectReceiveStream[dict[str, object]]:
        """A stream of every transition from now on (`watch`); the first item is the status."""
        return self.watchers.subscribe({"kind": "status", **msgspec.to_builtins(self.status())})

    async def command(
        self, name: str, *, steps: int | None = None, level: str | None = None
    ) -> int:
        """Tell the job (every node, through the job store), and journal it; the generation."""
        generation = await self.parts.store.record_command(name, steps=steps, level=level)
        said = {k: v for k, v in (("steps", steps), ("level", level)) if v is not None}
        self.journal_add("command", command=name, **said)
        return generation

    def use_config(self, config: Config, loaded: LoadedConfig | None = None) -> None:
        """Run on `config` from now on (a reload, a log level); `loaded`: the file as read."""
        self.config = config
        if loaded is not None:
            self.loaded = loaded

    # -- waiting and telling ---------------------------------------------------------------------

    async def wait_changed(self) -> None:
        """Until the next transition, lifecycle change or request."""
        await self._changed.wait()

    async def wait_stopping(self) -> None:
        """Until the service is stopping or failed (the daemon then has drain_s to exit)."""
        while self.state not in FINAL:
            await self.wait_changed()

    def cancel_cycle(self) -> None:
        if self._cycle_scope is not None:
            self._cycle_scope.cancel()

    def move(self, event: ServiceEvent, *, announce: bool = True) -> None:
        following = advance_service(self.state, event)
        if following is not self.state:
            self.state = following
            self.parts.metrics.lifecycle.state(following.value)
            if announce:
                entry = journal_entry("lifecycle", lifecycle=following.value, reason=self.reason)
                self.records.add(entry)
                self.watchers.publish(entry)
                self.parts.notifier.status(self.status_line())
        self._wake()

    def status_line(self) -> str:
        step = self.job.step if self.job else self.progress.committed_step
        phases = ",".join(p.value for p in self.job.phases) if self.job else "-"
        return f"{self.state.value} step {step} phases {phases}"

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def journal_add(self, kind: str, **fields: object) -> None:
        self.records.add(journal_entry(kind, **fields))
