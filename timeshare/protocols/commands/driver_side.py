"""The driver's end of the command lanes: one ROUTER per lane, every call with a deadline.

`WorkerLanes.call` sends a command on the work lane and waits for its result, watching three
things at once: the result; the worker's process (`worker_exited`, fed by `watch_process`, ends
the wait at once with `WorkerDied`); and the worker's progress count from its heartbeats (no
change for `stall_timeout_s` is `WorkerStalled`, unless the worker says it is waiting on its
peer, a wait that the weight channel's own deadlines bound). The deadline is `CommandTimeout`.
A command that raised in the worker comes back as `WorkerError` with the remote type and
message. `WorkerLanes.control` uses the control lane, answered while the work runs.

A work call that stalled or passed its deadline is aborted before the error is raised: `abort`
on the control lane interrupts it where it waits, and the worker logs where that was and
answers the call with `Aborted` (awaited for at most ABORT_S). A call stuck inside C code does
not end that way; its worker is killed with the cycle.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio

from timeshare.errors import (
    BadResult,
    CommandTimeout,
    ProtocolError,
    WorkerDied,
    WorkerError,
    WorkerFailure,
    WorkersNotReady,
    WorkerStalled,
)
from timeshare.protocols.commands import frames
from timeshare.protocols.commands.processes import WorkerId, describe_exit, worker_of
from timeshare.runtime import Endpoint

log = structlog.get_logger(__name__)

# How often a waiting call looks at exits, stalls and its deadline.
CHECK_S = 0.05
ABORT_S = 2.0  # for the control lane's answer to `abort`, then for the aborted call's
EXIT_REPORT_S = 2.0  # a worker gone from its socket: for its exit to be reported
LANES = ("work", "control")
R = TypeVar("R")


@dataclass
class _Liveness:
    lanes: set[str] = field(default_factory=set)  # lanes that said hello
    pid: int | None = None
    progress: int = 0
    progress_at: float = field(default_factory=time.monotonic)
    returncode: int | None = None
    why: str | None = None  # what ended it, when its exit status alone does not say
    exited: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class _Pending:
    worker: WorkerId
    command: str
    reply: frames.Result | frames.Failure | None = None
    done: anyio.Event = field(default_factory=anyio.Event)


class WorkerLanes:
    """Open with `async with WorkerLanes.open(runtime_dir, stall_timeout_s=...) as lanes`."""

    def __init__(self, runtime_dir: Path, *, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.endpoints = {
            lane: Endpoint.parse(f"ipc://{runtime_dir}/{lane}.sock") for lane in LANES
        }
        self._context = zmq.asyncio.Context(io_threads=1)
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._inodes: dict[str, int | None] = {}
        self._workers: dict[WorkerId, _Liveness] = {}
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)

    @classmethod
    @asynccontextmanager
    async def open(cls, runtime_dir: Path, *, stall_timeout_s: float) -> AsyncIterator[WorkerLanes]:
        lanes = cls(runtime_dir, stall_timeout_s=stall_timeout_s)
        try:
            # Clearing a stale socket file probes it with a connect: not on the event loop.
            await anyio.to_thread.run_sync(lanes._prepare_endpoints)
            lanes._bind()
            async with anyio.create_task_group() as group:
                for lane in LANES:
                    group.start_soon(lanes._receive, lane)
                yield lanes
                group.cancel_scope.cancel()
        finally:
            lanes._close()

    @property
    def work_endpoint(self) -> str:
        return self.endpoints["work"].url

    @property
    def control_endpoint(self) -> str:
        return self.endpoints["control"].url

    # -- liveness -----------------------------------------------------------------------------

    def expect(self, worker: WorkerId) -> None:
        """Track `worker` from now on (before it is spawned, so its hello is not missed)."""
        self._workers.setdefault(worker, _Liveness())

    async def wait_ready(self, workers: list[WorkerId], *, timeout_s: float) -> None:
        """Wait until every worker said hello on both lanes; a worker that exits first is fatal."""
        for worker in workers:
            self.expect(worker)
        with anyio.move_on_after(timeout_s):
            while not all(self._workers[w].lanes == set(LANES) for w in workers):
                for worker in workers:
                    self._raise_if_exited(worker, None)
                await anyio.sleep(CHECK_S)
            return
        late = [w for w in workers if self._workers[w].lanes != set(LANES)]
        message = f"workers not ready within {timeout_s:g} s: {', '.join(map(str, late))}"
        raise _failure(WorkersNotReady, late[0], None, message)

    def worker_exited(self, worker: WorkerId, returncode: int, why: str | None = None) -> None:
        """The worker's process is gone (`why`, if its own exit does not say it): every wait on
        it ends now."""
        liveness = self._workers.setdefault(worker, _Liveness())
        liveness.returncode = returncode
        liveness.why = why
        liveness.exited.set()
        for pending in self._pending.values():
            if pending.worker == worker:
                pending.done.set()

    # -- calls --------------------------------------------------------------------------------

    async def call(
        self,
        worker: WorkerId,
        command: str,
        params: dict[str, Any] | None = None,
        *,
        deadline_s: float,
        returns: type[R],
    ) -> R:
        """Run `command` on the worker's work lane; its result as `returns`, or a typed
        WorkerFailure (`BadResult` for an answer that is not a `returns`)."""
        reply = await self._call("work", worker, command, params or {}, deadline_s)
        try:
            return msgspec.msgpack.decode(reply, type=returns)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _failure(
                BadResult, worker, command, f"{worker} answered {command} with a bad result: {exc}"
            ) from exc

    async def control(
        self,
        worker: WorkerId,
        command: str,
        params: dict[str, Any] | None = None,
        *,
        timeout_s: float,
    ) -> Any:
        """`status`, `abort` or `log_level` on the control lane, answered while work runs."""
        reply = await self._call("control", worker, command, params or {}, timeout_s)
        return msgspec.msgpack.decode(reply)

    async def _call(
        self, lane: str, worker: WorkerId, command: str, params: dict[str, Any], deadline_s: float
    ) -> msgspec.Raw:
        self.expect(worker)
        self._raise_if_exited(worker, command)
        call_id = next(self._ids)
        pending = _Pending(worker, command)
        self._pending[call_id] = pending
        try:
            await self._send(lane, worker, frames.Call(call_id, command, params), deadline_s)
            await self._wait_for_reply(lane, pending, time.monotonic(), deadline_s)
        finally:
            del self._pending[call_id]
        return _outcome(worker, command, pending.reply)

    async def _send(
        self, lane: str, worker: WorkerId, call: frames.Call, deadline_s: float
    ) -> None:
        try:
            # Bounded like the rest of the call: a worker that stopped reading fills the queue.
            with anyio.fail_after(deadline_s):
                await self._sockets[lane].send_multipart([worker.routing_id, frames.encode(call)])
        except TimeoutError as exc:
            message = f"{worker} did not take {call.command} within {deadline_s:g} s"
            raise _failure(CommandTimeout, worker, call.command, message) from exc
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: nobody with that id is connected
            # Most often the worker has just died, and its exit is on its way from the process
            # watcher: that is the failure to report, not the socket it left.
            await self._exit_reported(worker, EXIT_REPORT_S)
            self._raise_if_exited(worker, call.command)
            message = f"{worker} is not connected on the {lane} lane: {exc}"
            raise _failure(WorkerFailure, worker, call.command, message) from exc

    async def _exit_reported(self, worker: WorkerId, within_s: float) -> None:
        """Wait up to `within_s` for the worker's exit to be reported (it may never come)."""
        with anyio.move_on_after(within_s):
            await self._workers[worker].exited.wait()

    async def _wait_for_reply(
        self, lane: str, pending: _Pending, started: float, deadline_s: float
    ) -> None:
        """Until the reply; the worker's exit, a stall (work lane) or the deadline end it."""
        worker, command = pending.worker, pending.command
        liveness = self._workers[worker]
        while True:
            with anyio.move_on_after(CHECK_S):
                await pending.done.wait()
            if pending.reply is not None:
                return
            self._raise_if_exited(worker, command)
            now = time.monotonic()
            if lane == "work" and now - max(started, liveness.progress_at) > self.stall_timeout_s:
                message = f"{worker} made no progress in {command} for {self.stall_timeout_s:g} s"
                await self._abort(pending)
                self._raise_if_exited(worker, command)  # it died meanwhile: that is what it was
                raise _failure(WorkerStalled, worker, command, message)
            if now - started > deadline_s:
                message = f"{worker} did not finish {command} within {deadline_s:g} s"
                if lane == "work":
                    await self._abort(pending)
                    self._raise_if_exited(worker, command)
                raise _failure(CommandTimeout, worker, command, message)

    async def _abort(self, pending: _Pending) -> None:
        """Interrupt the worker's call where it waits, and give it ABORT_S to answer it."""
        worker = pending.worker
        with anyio.CancelScope(shield=True):
            try:
                aborted = await self.control(worker, "abort", timeout_s=ABORT_S)
            except WorkerFailure as exc:
                log.warning("lanes.abort.missed", worker=str(worker), error=str(exc))
                return
            with anyio.move_on_after(ABORT_S):
                await pending.done.wait()
            log.warning("lanes.call.aborted", worker=str(worker), aborted=aborted)

    def _raise_if_exited(self, worker: WorkerId, command: str | None) -> None:
        liveness = self._workers[worker]
        returncode = liveness.returncode
        if returncode is not None:
            during = f" during {command}" if command else ""
            why = f" ({liveness.why})" if liveness.why else ""
            message = f"{worker} exited{during} with {describe_exit(returncode)}{why}"
            raise WorkerDied(
                message, rank=worker.rank, role=worker.role, command=command, returncode=returncode
            )

    # -- sockets ------------------------------------------------------------------------------

    def _prepare_endpoints(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.prepare_bind()

    def _bind(self) -> None:
        for lane, endpoint in self.endpoints.items():
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker is an error
            socket.bind(endpoint.url)
            self._sockets[lane] = socket
            self._inodes[lane] = endpoint.bound_inode()

    async def _receive(self, lane: str) -> None:
        socket = self._sockets[lane]
        while True:
            parts = await socket.recv_multipart()
            if len(parts) != 2:
                log.warning("lanes.frame.malformed", lane=lane, parts=len(parts))
                continue
            routing_id, data = parts
            try:
                frame = frames.decode_from_worker(data)
            except ProtocolError as exc:
                log.warning("lanes.frame.malformed", lane=lane, error=str(exc))
                continue
            self._dispatch(lane, routing_id, frame)

    def _dispatch(self, lane: str, routing_id: bytes, frame: frames.FromWorker) -> None:
        if isinstance(frame, frames.Hello):
            liveness = self._workers.setdefault(WorkerId(frame.role, frame.rank), _Liveness())
            liveness.lanes.add(frame.lane)
            liveness.pid = frame.pid
        elif isinstance(frame, frames.Heartbeat):
            worker = worker_of(routing_id)
            liveness = self._workers.setdefault(worker, _Liveness())
            if frame.progress != liveness.progress or frame.waiting:
                liveness.progress = frame.progress
                liveness.progress_at = time.monotonic()
        else:
            pending = self._pending.get(frame.id)
            if pending is None:
                log.debug("lanes.reply.late", lane=lane, id=frame.id)  # its caller gave up
                return
            pending.reply = frame
            pending.done.set()

    def _close(self) -> None:
        for socket in self._sockets.values():
            socket.close(linger=0)
        self._context.term()
        for lane, endpoint in self.endpoints.items():
            endpoint.remove_socket_file(self._inodes.get(lane))


def _outcome(
    worker: WorkerId, command: str, reply: frames.Result | frames.Failure | None
) -> msgspec.Raw:
    if isinstance(reply, frames.Failure):
        raise WorkerError(
            f"{worker} failed in {command}: {reply.type}: {reply.message}",
            rank=worker.rank,
            role=worker.role,
            command=command,
            remote_type=reply.type,
            remote_message=reply.message,
        )
    assert reply is not None
    return reply.value


F = TypeVar("F", bound=WorkerFailure)


def _failure(kind: type[F], worker: WorkerId, command: str | None, message: str) -> F:
    """A failure of `kind` naming the worker and its command."""
    return kind(message, rank=worker.rank, role=worker.role, command=command)
