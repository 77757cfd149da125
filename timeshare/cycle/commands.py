"""Commands of the job store, read in order and turned into the machine's events.

An operator's pause, resume, drain, stop or new step limit is written to the job store under a
fresh generation (by the service, on any node), so that every node applies each one once, in
order, at the same safe point (the machine holds it for a crossing of the nodes where needed).
A `log_level` goes to every worker's control lane instead (it is answered while work runs). A
command that names nothing known is logged and skipped.
"""

from __future__ import annotations

from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from timeshare.cycle.workers import Workers
from timeshare.errors import TimeshareError
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.commands.params import LogLevelParams
from timeshare.protocols.store import AsyncJobStore, JobCommand
from timeshare.state import Commanded, Request, Requested, StepsChanged

log = structlog.get_logger(__name__)

POLL_S = 0.05  # one node: the poll is how commands arrive
# Several nodes: every crossing (three a step) reads the commands through the newest any node
# has seen, so a running job gets them there; the poll brings only those between crossings (a
# paused job's resume). A tenth of the requests: 2,048/s at 1,024 nodes, not 20,480/s.
NODES_POLL_S = 0.5
# Commands read before the cycle starts, at most (the rest follow with the watch): well within
# the runner's inbox, which nobody reads until the cycle starts.
CATCH_UP = 100
READ_S = 5.0  # a command's generation is taken before its value is written
LOG_LEVEL_TIMEOUT_S = 5.0
# For daemons idle on other nodes (daemon/service.py): a running cycle has nothing to do with it.
IDLE_START = "start"


def event_of(command: JobCommand) -> Requested | StepsChanged | None:
    """The machine's event for a command of the job store, or None for one it cannot name."""
    if command.command == "steps":
        return None if command.steps is None else StepsChanged(command.steps)
    try:
        return Requested(Request(command.command))
    except ValueError:
        return None


class CommandFeed:
    """Reads the job store's commands once each, in order, and sends each to the cycle.

    `watch` reads what is written as it comes; a crossing of the nodes reads up to the agreed
    generation at once (`read_through`), so that every command up to it is in the cycle's inbox
    before the crossing's own report.
    """

    def __init__(
        self,
        store: AsyncJobStore,
        reports: MemoryObjectSendStream[Any],
        after: int,
        workers: Workers,
        worker_ids: list[WorkerId],
        *,
        poll_s: float = POLL_S,
    ) -> None:
        self.store = store
        self.poll_s = poll_s
        self.reports = reports
        self.read = after  # the generation read last
        self.workers = workers
        self.worker_ids = worker_ids
        self._reading = anyio.Lock()

    async def catch_up(self) -> None:
        """Feed the commands written already (up to CATCH_UP): read before the cycle starts, a
        command written before the run applies at its first boundary, not whenever the
        watch's first poll returns."""
        latest = await self.store.latest_command()
        await self.read_through(min(latest, self.read + CATCH_UP))

    async def watch(self) -> None:
        """Feed every command written after the last `read`, until cancelled."""
        while True:
            await self.read_through(await self.store.latest_command())
            await anyio.sleep(self.poll_s)

    async def read_through(self, latest: int) -> None:
        """Send every command up to generation `latest` not sent yet."""
        async with self._reading:
            for generation in range(self.read + 1, latest + 1):
                await self._read(generation)
            self.read = max(self.read, latest)

    async def _read(self, generation: int) -> None:
        try:
            command = await self.store.command(generation, timeout_s=READ_S)
        except TimeoutError:  # its writer died between taking the generation and writing
            log.warning("cycle.command.lost", generation=generation, waited_s=READ_S)
            return
        if command is not None and command.command == "log_level":
            await _set_log_level(self.workers, self.worker_ids, command)
            return
        if command is not None and command.command == IDLE_START:
            return
        event = None if command is None else event_of(command)
        if command is None or event is None:
            log.warning("cycle.command.unknown", generation=generation, command=command)
            return
        log.info("cycle.command.received", generation=generation, command=command.command)
        await self.reports.send(Commanded(generation, event))


async def _set_log_level(workers: Workers, worker_ids: list[WorkerId], command: JobCommand) -> None:
    """Over the control lanes, answered while work runs; a worker that misses it is logged."""
    if command.level is None:
        log.warning("cycle.log_level.without_level", command=command.command)
        return
    level = LogLevelParams(command.level)
    for worker in worker_ids:
        try:
            await workers.control(
                worker, "log_level", level, timeout_s=LOG_LEVEL_TIMEOUT_S, returns=str
            )
        except TimeshareError as exc:
            log.warning("cycle.log_level.missed", worker=str(worker), error=str(exc))
