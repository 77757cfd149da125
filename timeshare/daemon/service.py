"""The service: one job's cycle under an operator's control, for as long as the daemon runs.

`timeshared` is this plus its fronts (control socket, systemd, metrics); `timeshare run` uses the
same driver without it. The service runs the cycle until the job's steps are done, then stays
up `idle`, answering, until it is stopped. Operator commands that change the cycle (pause,
resume, drain, stop, a new step limit) are written to the job store, as every node would read
them; the driver applies them at its safe points. Everything the service learns is kept for
`status`, streamed to `watch`ers, appended to the journal, sent to systemd and to the metrics.

Lifecycle as shown: starting, running, paused, draining (the machine's), then `idle` (no cycle:
steps done or drained), `stopping` (exit requested, the cycle drains) and `failed` (the cycle
failed; the daemon exits 1 so that systemd restarts it, and the restart resumes from the
committed step).
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from timeshare import logs
from timeshare.config import Config, LoadedConfig, flat, load_config
from timeshare.daemon.driver import BootstrapRecord, CycleHooks, PhaseRecord, run_cycle
from timeshare.daemon.metrics import Metrics
from timeshare.daemon.progress import JobProgress
from timeshare.daemon.records import RecordWriter, journal_entry, read_progress
from timeshare.daemon.systemd import Notifier
from timeshare.errors import ConfigError, CycleFailed
from timeshare.protocols.control import (
    Call,
    LogLevelParams,
    NotRunning,
    ReloadRefused,
    TransitionRefused,
    WaitParams,
    WaitTimedOut,
)
from timeshare.protocols.store import JobStore
from timeshare.state import JobState, Lifecycle

log = structlog.get_logger(__name__)

# Keys a reload may change while the cycle runs; any other changed key refuses the reload.
LIVE_KEYS = ("job.steps", "deadlines.", "log.level")
LAG_PROBE_S = 0.01
WATCH_BUFFER = 256  # events a watcher may fall behind by before it is dropped
# Lifecycles in which the cycle must keep making transitions (the watchdog's test).
MOVING_STATES = frozenset({"starting", "running", "draining", "stopping"})


@dataclass(frozen=True)
class ServicePaths:
    config_file: Path
    state_dir: Path
    socket: Path


class Service:
    def __init__(
        self,
        loaded: LoadedConfig,
        config: Config,
        paths: ServicePaths,
        *,
        notifier: Notifier,
        metrics: Metrics,
    ) -> None:
        self.loaded = loaded  # as read: what a reload compares with
        self.config = config  # with the daemon's paths resolved
        self.paths = paths
        self.notifier = notifier
        self.metrics = metrics
        saved = read_progress(paths.state_dir)
        self.progress = JobProgress(config.job.ranks, metrics, saved)
        self.records = RecordWriter(paths.state_dir, self.progress.snapshot)
        self.lifecycle = "starting"
        self.job: JobState | None = None
        self.reason: str | None = None
        self.started = time.monotonic()
        self.last_progress = time.monotonic()
        self.metrics_port: int | None = None
        self.loop_lag_max_s = 0.0  # the event loop's worst delay seen (LAG_PROBE_S probes)
        self.exit_code = 0
        self.exit_requested = False
        self.want_cycle = True
        self.ready_sent = False
        self.store: JobStore | None = None
        self._cycle_scope: anyio.CancelScope | None = None
        self._changed = anyio.Event()
        self._watchers: set[MemoryObjectSendStream[dict[str, Any]]] = set()

    # -- what status shows -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        job = self.job
        return {
            "lifecycle": self.shown_lifecycle,
            "phases": [p.value for p in job.phases] if job and self.cycle_active else [],
            "step": job.step if job else self.progress.committed_step,
            "steps": self.config.job.steps,
            "committed_step": self.progress.committed_step,
            "weight_version": self.progress.weight_version,
            "last_step": self.progress.last_step,
            "reason": self.reason,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "pid": os.getpid(),
            "ranks": self.config.job.ranks,
            "engine": self.config.engine.kind,
            "metrics_port": self.metrics_port,
            "log_level": self.config.log.level,
            "loop_lag_max_ms": round(self.loop_lag_max_s * 1000, 3),
        }

    @property
    def shown_lifecycle(self) -> str:
        if self.lifecycle == "failed":
            return "failed"
        if self.exit_requested:
            return "stopping"
        return self.lifecycle

    @property
    def cycle_active(self) -> bool:
        return self._cycle_scope is not None

    # -- the cycle -------------------------------------------------------------------------------

    async def run_cycles(self) -> None:
        """Run a cycle whenever one is wanted and steps remain; idle otherwise; until exit."""
        while not self.exit_requested:
            if self.want_cycle and self._steps_remain():
                self.want_cycle = False
                await self._run_cycle()
                await self.records.flush()  # what the cycle did is on disk before it says idle
                continue
            self.want_cycle = False
            self._set_lifecycle("idle")
            if not self.ready_sent:  # nothing to start: up and answering is ready
                self.ready_sent = True
                self.notifier.ready(self._status_line())
            await self.wait_changed()

    def _steps_remain(self) -> bool:
        return (
            self.progress.committed_step is None
            or self.progress.committed_step < self.config.job.steps
        )

    async def _run_cycle(self) -> None:
        assert self.store is not None
        self.reason = None
        self._set_lifecycle("starting")
        baseline = await anyio.to_thread.run_sync(self.store.add, "gen/command", 0)
        hooks = CycleHooks(
            observer=self._observe,
            on_state=self._on_state,
            deadlines=lambda: self.config.deadlines,
            keep_records=False,
            commands_from=baseline,
        )
        try:
            with anyio.CancelScope() as scope:
                self._cycle_scope = scope
                summary = await run_cycle(self.config, self.store, hooks=hooks)
                self.reason = summary.reason
                self._journal_add("cycle.stopped", step=summary.step, reason=summary.reason)
            if scope.cancelled_caught:
                self.reason = f"drain took longer than {self.config.daemon.drain_s:g} s"
                self.exit_code = 1
                self._journal_add("cycle.cancelled", reason=self.reason)
                log.error("service.drain.overdue", drain_s=self.config.daemon.drain_s)
        except CycleFailed as failed:
            self._fail(failed)
        finally:
            self._cycle_scope = None
            self.progress.cycle_ended()

    def _fail(self, failed: CycleFailed) -> None:
        kind = type(failed.cause).__name__
        self.metrics.failed(kind)
        self.reason = str(failed)
        self._journal_add(
            "cycle.failed",
            rank=failed.rank,
            role=failed.role,
            phase=failed.phase,
            error_kind=kind,
            error=str(failed),
        )
        self._set_lifecycle("failed")
        self.exit_code = 1
        self.exit_requested = True  # systemd restarts a failed service; the restart resumes
        self.notifier.stopping(f"failed: {failed}")
        log.error("service.cycle.failed", error=str(failed), kind=kind)

    def _on_state(self, state: JobState) -> None:
        """Every transition of the running cycle (synchronous: must return at once)."""
        self.job = state
        self.last_progress = time.monotonic()
        lifecycle = state.lifecycle.value
        if state.lifecycle is Lifecycle.STOPPED:
            lifecycle = "draining"  # the cycle is shutting its workers down; then idle
        self.reason = state.reason
        self._set_lifecycle(lifecycle, announce=False)
        if not self.ready_sent and state.lifecycle is Lifecycle.RUNNING:
            self.ready_sent = True
            self.notifier.ready(self._status_line())  # workers up, checkpoint loaded
        else:
            self.notifier.status(self._status_line())
        entry = journal_entry(
            "transition",
            lifecycle=state.lifecycle.value,
            step=state.step,
            phases=[p.value for p in state.phases],
            reason=state.reason,
        )
        self.records.add(entry)
        self._publish(entry)

    async def _observe(self, record: PhaseRecord | BootstrapRecord) -> None:
        """Every phase that ended well (awaited by the driver: only in-memory work here)."""
        self.last_progress = time.monotonic()
        if isinstance(record, BootstrapRecord):
            entries = self.progress.bootstrapped(record.step) if record.rank == 0 else []
        else:
            entries = self.progress.phase_ended(record)
        if entries:
            self.records.add(*entries)
            self.records.progress_changed()

    # -- operator commands -----------------------------------------------------------------------

    async def pause(self, params: WaitParams) -> dict[str, Any]:
        self._require({"starting", "running", "paused"}, "pause")
        if self.lifecycle != "paused":
            await self._command("pause")
        if params.wait:
            await self._wait_for({"paused"}, params.timeout_s, "pause")
        return self.status()

    async def resume(self) -> dict[str, Any]:
        if self.shown_lifecycle == "idle":
            if not self._steps_remain():
                raise NotRunning(
                    f"all {self.config.job.steps} steps are done; raise job.steps and reload"
                )
            self.want_cycle = True
            self._wake()
            return self.status()
        self._require({"starting", "running", "paused"}, "resume")
        await self._command("resume")
        return self.status()

    async def drain(self, params: WaitParams) -> dict[str, Any]:
        if self.shown_lifecycle in ("starting", "running", "paused"):
            await self._command("drain")
        elif self.shown_lifecycle == "failed":
            raise NotRunning("the cycle failed; nothing to drain")
        if params.wait:
            await self._wait_for({"idle"}, params.timeout_s, "drain")
        return self.status()

    async def stop(self, why: str) -> dict[str, Any]:
        """Drain at once and exit (SIGTERM, `stop`); repeating it changes nothing."""
        if not self.exit_requested:
            self.exit_requested = True
            self._journal_add("service.stop", why=why)
            log.info("service.stop.requested", why=why)
            self.notifier.stopping(f"stopping: {why}")
            self.metrics.lifecycle.state("stopping")
            if self.cycle_active:
                await self._command("stop")
            self._wake()
        return self.status()

    async def reload(self) -> dict[str, Any]:
        """Re-read the config: apply what may change live, refuse the rest, keep it on error."""
        self.notifier.reloading()
        try:
            changed = await self._reload()
        finally:
            self.notifier.ready(self._status_line())
        return {"changed": changed, "status": self.status()}

    async def _reload(self) -> dict[str, Any]:
        try:
            loaded = await anyio.to_thread.run_sync(load_config, self.paths.config_file)
        except ConfigError as exc:
            self._journal_add("reload.refused", error=str(exc))
            raise ReloadRefused(f"the running config stays: {exc}") from exc
        before, after = flat(self.loaded.config), flat(loaded.config)
        changed = {
            k: after.get(k)
            for k in sorted(set(before) | set(after))
            if before.get(k) != after.get(k)
        }
        fixed = [k for k in changed if not k.startswith(LIVE_KEYS)]
        if fixed:
            self._journal_add("reload.refused", keys=fixed)
            raise ReloadRefused(
                f"cannot change while the service runs: {', '.join(fixed)} "
                "(restart the service for these); the running config stays"
            )
        # The file's live values win, also over a `log-level` set since the last read.
        new, running = loaded.config, self.config
        job = msgspec.structs.replace(running.job, steps=new.job.steps)
        log_section = msgspec.structs.replace(running.log, level=new.log.level)
        self.config = msgspec.structs.replace(
            running, job=job, deadlines=new.deadlines, log=log_section
        )
        self.loaded = loaded
        if new.log.level != running.log.level:
            logs.set_level(new.log.level)
            if self.cycle_active:
                await self._command("log_level", level=new.log.level)
        if new.job.steps != running.job.steps and self.cycle_active:
            await self._command("steps", steps=new.job.steps)
        self._journal_add("reload.applied", changed=changed)
        log.info("service.reload.applied", changed=changed)
        return changed

    async def set_log_level(self, params: LogLevelParams) -> dict[str, Any]:
        """The daemon's level at once; its workers' through the job store (all nodes)."""
        logs.set_level(params.level)
        if self.cycle_active:
            await self._command("log_level", level=params.level)
        self.config = msgspec.structs.replace(
            self.config, log=msgspec.structs.replace(self.config.log, level=params.level)
        )
        self._journal_add("log_level", level=params.level)
        return {"log_level": params.level}

    async def handle(self, call: Call) -> Any:
        """One control request (not `watch`, which the server streams)."""
        if call.method == "status":
            return self.status()
        requests: dict[str, Callable[[], Awaitable[Any]]] = {
            "pause": lambda: self.pause(call.params),
            "resume": self.resume,
            "drain": lambda: self.drain(call.params),
            "stop": lambda: self.stop("control socket"),
            "reload": self.reload,
            "set_log_level": lambda: self.set_log_level(call.params),
        }
        return await requests[call.method]()

    def subscribe(self) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """A stream of every transition from now on (`watch`); the first item is the status."""
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](WATCH_BUFFER)
        send.send_nowait({"kind": "status", **self.status()})
        self._watchers.add(send)
        return receive

    def _require(self, states: set[str], request: str) -> None:
        shown = self.shown_lifecycle
        if shown in states:
            return
        if shown in ("idle", "failed"):
            raise NotRunning(f"{request}: no cycle is running ({shown})")
        raise TransitionRefused(f"{request} is not possible while {shown}")

    async def _command(self, name: str, **params: Any) -> None:
        assert self.store is not None
        store = self.store
        await anyio.to_thread.run_sync(lambda: store.record_command(name, **params))
        self._journal_add("command", command=name, **params)

    async def _wait_for(self, states: set[str], timeout_s: float, request: str) -> None:
        with anyio.move_on_after(timeout_s):
            while self.shown_lifecycle not in states:
                if self.shown_lifecycle in {"failed", "idle"} - states:
                    raise NotRunning(f"{request}: the cycle ended ({self.shown_lifecycle})")
                await self.wait_changed()
            return
        raise WaitTimedOut(f"{request} did not take effect within {timeout_s:g} s")

    async def wait_exit_requested(self) -> None:
        while not self.exit_requested:
            await self.wait_changed()

    # -- keeping everyone told ---------------------------------------------------------------------

    def _set_lifecycle(self, lifecycle: str, *, announce: bool = True) -> None:
        if lifecycle != self.lifecycle:
            self.lifecycle = lifecycle
            self.metrics.lifecycle.state(lifecycle)
            if announce:
                entry = journal_entry("lifecycle", lifecycle=lifecycle, reason=self.reason)
                self.records.add(entry)
                self._publish(entry)
                self.notifier.status(self._status_line())
        self._wake()

    def _status_line(self) -> str:
        step = self.job.step if self.job else self.progress.committed_step
        phases = ",".join(p.value for p in self.job.phases) if self.job else "-"
        return f"{self.shown_lifecycle} step {step} phases {phases}"

    def _publish(self, entry: dict[str, Any]) -> None:
        for watcher in list(self._watchers):
            try:
                watcher.send_nowait(entry)
            except anyio.WouldBlock:  # too slow: drop it rather than hold the cycle
                watcher.close()
                self._watchers.discard(watcher)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._watchers.discard(watcher)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_changed(self) -> None:
        """Until the next transition, lifecycle change or request."""
        await self._changed.wait()

    def _journal_add(self, kind: str, **fields: Any) -> None:
        self.records.add(journal_entry(kind, **fields))

    async def measure_loop_lag(self) -> None:
        """How late the event loop wakes a sleeper: what every control request waits at worst."""
        while True:
            before = time.monotonic()
            await anyio.sleep(LAG_PROBE_S)
            lag = time.monotonic() - before - LAG_PROBE_S
            if lag > self.loop_lag_max_s:
                self.loop_lag_max_s = lag
                self.metrics.loop_lag.set(lag)

    def cancel_cycle(self) -> None:
        if self._cycle_scope is not None:
            self._cycle_scope.cancel()

    def healthy(self) -> bool:
        """Whether the watchdog should be fed: a cycle that runs must have moved lately."""
        if self.shown_lifecycle not in MOVING_STATES or not self.cycle_active:
            return True  # idle or paused: nothing is supposed to move
        deadlines = self.config.deadlines
        longest = max([deadlines.phase_s, deadlines.ready_s, *deadlines.commands.values()])
        return time.monotonic() - self.last_progress < longest + deadlines.stall_s
