"""An operator's requests, over the control socket or by signal: each one answered as the
service's table says (state/service.py), then performed.

Repeating a request is harmless. `--wait` answers once the request took effect, or says why it
never will. A reload applies the keys that may change live and refuses the rest by name,
keeping the running config whole; it answers once the new values are in force.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import msgspec
import structlog

from timeshare import logs
from timeshare.config import changes, load_config, with_live_values
from timeshare.daemon.service import START, STOP, Service
from timeshare.errors import ConfigError, NotRunning, ReloadRefused, WaitTimeout
from timeshare.protocols.control import Call, LogLevelParams, ServiceStatus, WaitParams
from timeshare.state import Request
from timeshare.state.service import FINAL, Answer, StopRequested, answer, waited

log = structlog.get_logger(__name__)


class OperatorRequests:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def handle(self, call: Call) -> object:
        """One control request (not `watch`, which the server streams)."""
        requests: dict[str, Callable[[], Awaitable[object]]] = {
            "status": self.status,
            "pause": lambda: self.pause(call.params),
            "resume": self.resume,
            "drain": lambda: self.drain(call.params),
            "stop": lambda: self.stop("control socket"),
            "reload": self.reload,
            "set_log_level": lambda: self.set_log_level(call.params),
        }
        return await requests[call.method]()

    async def status(self) -> ServiceStatus:
        return self.service.status()

    async def pause(self, params: WaitParams) -> ServiceStatus:
        if self._answer(Request.PAUSE) is Answer.FORWARD:
            await self.service.command("pause")
        if params.wait:
            await self._wait_for(Request.PAUSE, params.timeout_s)
        return self.service.status()

    async def resume(self) -> ServiceStatus:
        verdict = self._answer(Request.RESUME)
        if verdict is Answer.START_CYCLE:
            await self.service.want_cycle()
            await self.service.tell_idle_nodes(START)  # (after: this cycle skips it)
        elif verdict is Answer.FORWARD:
            await self.service.command("resume")
        return self.service.status()

    async def drain(self, params: WaitParams) -> ServiceStatus:
        if self._answer(Request.DRAIN) is Answer.FORWARD:
            await self.service.command("drain")
        if params.wait:
            await self._wait_for(Request.DRAIN, params.timeout_s)
        return self.service.status()

    async def stop(self, why: str) -> ServiceStatus:
        """Drain at once and exit (SIGTERM, `stop`); repeating it changes nothing."""
        service = self.service
        verdict = self._answer(Request.STOP)
        if service.state not in FINAL:
            service.move(StopRequested())
            service.journal_add("service.stop", why=why)
            log.info("service.stop.requested", why=why)
            service.parts.notifier.stopping(f"stopping: {why}")
        if verdict is Answer.FORWARD:
            await service.command("stop")
        else:
            await service.tell_idle_nodes(STOP)
        return service.status()

    async def reload(self) -> dict[str, object]:
        """Re-read the config: apply what may change live, refuse the rest, keep it on error."""
        notifier = self.service.parts.notifier
        notifier.reloading()
        try:
            changed = await self._reload()
        finally:
            notifier.ready(self.service.status_line())
        return {"changed": changed, "status": self.service.status()}

    async def set_log_level(self, params: LogLevelParams) -> dict[str, object]:
        """The daemon's level at once; its workers' through the job store (all nodes)."""
        config = self.service.config
        await self._set_level(params.level)
        log_section = msgspec.structs.replace(config.log, level=params.level)
        self.service.use_config(msgspec.structs.replace(config, log=log_section))
        self.service.journal_add("log_level", level=params.level)
        return {"log_level": params.level}

    async def _reload(self) -> dict[str, object]:
        service = self.service
        try:
            loaded = await anyio.to_thread.run_sync(load_config, service.paths.config_file)
        except ConfigError as exc:
            service.journal_add("reload.refused", error=str(exc))
            raise ReloadRefused(f"the running config stays: {exc}") from exc
        diff = changes(service.loaded.config, loaded.config)
        if diff.fixed:
            service.journal_add("reload.refused", keys=diff.fixed)
            raise ReloadRefused(
                f"cannot change while the service runs: {', '.join(diff.fixed)} "
                "(restart the service for these); the running config stays"
            )
        running = service.config
        service.use_config(with_live_values(running, loaded.config), loaded)  # the file wins
        new = service.config
        if new.log.level != running.log.level:
            await self._set_level(new.log.level)
        if new.job.steps != running.job.steps and service.cycle_runs:
            await service.command("steps", steps=new.job.steps)
        service.journal_add("reload.applied", changed=diff.changed)
        log.info("service.reload.applied", changed=diff.changed)
        return diff.changed

    def _answer(self, request: Request) -> Answer:
        service = self.service
        return answer(request, service.state, steps_left=service.steps_left())

    async def _set_level(self, level: str) -> None:
        logs.set_level(level)
        if self.service.cycle_runs:
            await self.service.command("log_level", level=level)

    async def _wait_for(self, request: Request, timeout_s: float) -> None:
        with anyio.move_on_after(timeout_s):
            try:
                while not waited(request, self.service.state):
                    await self.service.wait_changed()
            except NotRunning as exc:  # say why the cycle ended, as status would
                reason = self.service.reason
                raise NotRunning(f"{exc}: {reason}" if reason else str(exc)) from None
            return
        raise WaitTimeout(f"{request.value} did not take effect within {timeout_s:g} s")
