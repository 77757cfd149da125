"""The driver's end of the command lanes: every call with a deadline. What serves it (the
listening sockets, each worker's connections, liveness and pending calls) is lane_server.py.

`WorkerLanes.call` sends a command on the work lane and waits for its result, watching three
things at once: the result; the worker's process (`worker_exited`, fed by `watch_process`, ends
the wait at once with `WorkerDied`); and the worker's heartbeats. A heartbeat saying the call
has gone `stall_timeout_s` without progress is `WorkerStalled`; so is no heartbeat at all for as
long while this driver was watching, and a call the worker never started while its heartbeats
say it is on another (one it would not let go of). The rule is state/stall.py's: it blames no
worker for the machine's time (a driver held up, a worker starved of CPU). The deadline is
`CommandTimeout`.
A command that raised in the worker comes back as `WorkerError` with the remote type and
message. `WorkerLanes.control` uses the control lane, answered while the work runs.

A work call that stalled or passed its deadline is aborted before the error is raised: `abort`
on the control lane interrupts it where it waits, and the worker logs where that was and
answers the call with `Aborted` (awaited for at most ABORT_S). A call stuck inside C code does
not end that way; its worker is killed with the cycle.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import anyio
import msgspec
import structlog

from timeshare.errors import (
    BadResult,
    CommandTimeout,
    WorkerDied,
    WorkerError,
    WorkerFailure,
    WorkersNotReady,
    WorkerStalled,
)
from timeshare.protocols.commands import frames
from timeshare.protocols.commands.cpu_wait import cpu_wait_since
from timeshare.protocols.commands.lane_server import LANES, LaneServer, PendingCall
from timeshare.protocols.commands.params import encode as encode_params
from timeshare.protocols.commands.processes import WorkerId, describe_exit
from timeshare.state.stall import CallHealth, CallSeen, judge_call

log = structlog.get_logger(__name__)

# How often a waiting call looks at exits, stalls and its deadline.
CHECK_S = 0.05
# A check this late means the driver itself was held up: silence is timed afresh from then.
DRIVER_LATE_S = 1.0
ABORT_S = 2.0  # for the control lane's answer to `abort`, then for the aborted call's
EXIT_REPORT_S = 2.0  # a worker gone from its socket: for its exit to be reported
R = TypeVar("R")


class LaneCall(NamedTuple):
    """One command of `WorkerLanes.call_all`: `command` on `worker` with `params` (a Struct of
    params.py; anything msgpack encodes), answered as a `returns`."""

    worker: WorkerId
    command: str
    params: object
    returns: type[Any]


class WorkerLanes:
    """Open with `async with WorkerLanes.open(runtime_dir, stall_timeout_s=...) as lanes`."""

    def __init__(self, runtime_dir: Path, *, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.server = LaneServer(runtime_dir)
        self.endpoints = self.server.endpoints
        self._workers = self.server.workers
        self._pending = self.server.pending
        self._ids = itertools.count(1)
        self._checked_at = time.monotonic()  # the last check of a waiting call
        self._watching_since = self._checked_at  # checks on schedule since (see _check_on)

    @classmethod
    @asynccontextmanager
    async def open(cls, runtime_dir: Path, *, stall_timeout_s: float) -> AsyncIterator[WorkerLanes]:
        lanes = cls(runtime_dir, stall_timeout_s=stall_timeout_s)
        try:
            # Clearing a stale socket file probes it with a connect: not on the event loop.
            bound = await anyio.to_thread.run_sync(lanes.server.bind)
            await lanes.server.serve(bound)
            yield lanes
        finally:
            with anyio.CancelScope(shield=True):
                await lanes.server.close()

    @property
    def work_endpoint(self) -> str:
        return self.endpoints["work"].url

    @property
    def control_endpoint(self) -> str:
        return self.endpoints["control"].url

    # -- liveness -----------------------------------------------------------------------------

    def expect(self, worker: WorkerId) -> None:
        """Track `worker` from now on (before it is spawned, so its hello is not missed)."""
        self.server.liveness(worker)

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
        self.server.worker_exited(worker, returncode, why)

    # -- calls --------------------------------------------------------------------------------

    async def call(
        self,
        worker: WorkerId,
        command: str,
        params: object = None,
        *,
        deadline_s: float,
        returns: type[R],
    ) -> R:
        """Run `command` on the worker's work lane; its result as `returns`, or a typed
        WorkerFailure (`BadResult` for an answer that is not a `returns`)."""
        call = LaneCall(worker, command, params, returns)
        reply = (await self._call_all("work", [(worker, command, params)], deadline_s))[0]
        result: R = _decoded(call, reply)
        return result

    async def call_all(self, calls: Sequence[LaneCall], *, deadline_s: float) -> list[object]:
        """Run every call at once, each on its worker's work lane; their results in order. The
        first failure of any is raised as `call` raises it, and the wait for the others ends
        (their late answers are dropped): a phase's pair of calls, waited for as one."""
        commands = [(call.worker, call.command, call.params) for call in calls]
        replies = await self._call_all("work", commands, deadline_s)
        return [_decoded(call, reply) for call, reply in zip(calls, replies, strict=True)]

    async def control(
        self,
        worker: WorkerId,
        command: str,
        params: object = None,
        *,
        timeout_s: float,
        returns: type[R],
    ) -> R:
        """`status` (a `WorkerStatus`), `abort` (the command aborted, or None) or `log_level`
        (the level set) on the control lane, answered while work runs."""
        reply = await self._call("control", worker, command, params, timeout_s)
        result: R = _decoded(LaneCall(worker, command, params, returns), reply)
        return result

    async def _call(
        self, lane: str, worker: WorkerId, command: str, params: object, deadline_s: float
    ) -> msgspec.Raw:
        return (await self._call_all(lane, [(worker, command, params)], deadline_s))[0]

    async def _call_all(
        self,
        lane: str,
        calls: Sequence[tuple[WorkerId, str, object]],
        deadline_s: float,
    ) -> list[msgspec.Raw]:
        for worker, command, _ in calls:
            self.expect(worker)
            self._raise_if_exited(worker, command)
        pending: dict[int, PendingCall] = {}
        try:
            for worker, command, params in calls:
                call_id = next(self._ids)
                pending[call_id] = self._pending[call_id] = PendingCall(call_id, worker, command)
                call = frames.Call(call_id, command, encode_params(params))
                await self._send(lane, worker, call, deadline_s)
            await self._wait_for_replies(lane, list(pending.values()), time.monotonic(), deadline_s)
        finally:
            for call_id in pending:
                del self._pending[call_id]
        return [_outcome(p.worker, p.command, p.reply) for p in pending.values()]

    async def _send(
        self, lane: str, worker: WorkerId, call: frames.Call, deadline_s: float
    ) -> None:
        try:
            connection = self.server.peer(lane, worker)
            if connection is None:
                raise ConnectionResetError("it is not connected")
            connection.send(frames.encode(call))
            if connection.backed_up:  # bounded like the rest of the call: it stopped reading
                with anyio.fail_after(deadline_s):
                    await connection.drained()
        except TimeoutError as exc:
            message = f"{worker} did not take {call.command} within {deadline_s:g} s"
            raise _failure(CommandTimeout, worker, call.command, message) from exc
        except ConnectionError as exc:
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

    async def _wait_for_replies(
        self, lane: str, pending: list[PendingCall], started: float, deadline_s: float
    ) -> None:
        """Until every reply, or the first failure of any: a failure answered, a worker's exit,
        a stall (work lane) or the deadline."""
        while True:
            waiting = [p for p in pending if p.reply is None]
            _raise_first_failure(pending)
            if not waiting:
                return
            wake = anyio.Event()
            for p in waiting:
                p.wake = wake
            if not any(p.done.is_set() for p in waiting):
                with anyio.move_on_after(CHECK_S):
                    await wake.wait()
            _raise_first_failure(pending)
            now = self._checked()
            for p in waiting:
                if p.reply is None:
                    await self._check_on(lane, p, started, now, deadline_s)

    def _checked(self) -> float:
        """Now, noting when this driver's checks ran late: whatever held it up (its own loop,
        the machine, a paused VM) also held up the heartbeats it would have read."""
        now = time.monotonic()
        if now - self._checked_at > DRIVER_LATE_S:
            self._watching_since = now
        self._checked_at = now
        return now

    def _stall(self, pending: PendingCall, started: float, now: float) -> str | None:
        """Why the call counts as stalled (state/stall.py judges), or None."""
        liveness, limit = self._workers[pending.worker], self.stall_timeout_s
        seen = CallSeen(
            started=started,
            heard_at=liveness.heard_at,
            on_this_call=liveness.busy == pending.id,
            idle_s=liveness.idle_s,
            watching_since=self._watching_since,
            now=now,
        )
        health = judge_call(seen, limit)
        if health is CallHealth.SILENT and liveness.pid is not None and liveness.cpu_time.ran_ns:
            # Since its last heartbeat, by the rule its heartbeats' idleness was judged by.
            since_s = now - liveness.heard_at
            starved_s = cpu_wait_since(liveness.pid, liveness.cpu_time, since_s)
            health = judge_call(dataclasses.replace(seen, starved_s=starved_s), limit)
        worker, command = pending.worker, pending.command
        if health is CallHealth.NO_PROGRESS:
            return f"{worker} made no progress in {command} for {limit:g} s"
        if health is CallHealth.NOT_STARTED:
            return f"{worker} made no progress in {command} for {limit:g} s (it has not started it)"
        if health is CallHealth.SILENT:
            return f"{worker} sent no heartbeat in {command} for {limit:g} s"
        return None

    async def _check_on(
        self, lane: str, pending: PendingCall, started: float, now: float, deadline_s: float
    ) -> None:
        """Raise if the call cannot be answered any more: its worker exited, stalled (aborted
        first), or the deadline passed (aborted first)."""
        worker, command = pending.worker, pending.command
        self._raise_if_exited(worker, command)
        stalled = self._stall(pending, started, now) if lane == "work" else None
        if stalled is not None:
            message = stalled
            await self._abort(pending)
            self._raise_if_exited(worker, command)  # it died meanwhile: that is what it was
            raise _failure(WorkerStalled, worker, command, message)
        if now - started > deadline_s:
            message = f"{worker} did not finish {command} within {deadline_s:g} s"
            if lane == "work":
                await self._abort(pending)
                self._raise_if_exited(worker, command)
            raise _failure(CommandTimeout, worker, command, message)

    async def _abort(self, pending: PendingCall) -> None:
        """Interrupt the worker's call where it waits, and give it ABORT_S to answer it."""
        worker = pending.worker
        with anyio.CancelScope(shield=True):
            try:
                # (the command it aborted, or None: only logged)
                aborted = await self.control(worker, "abort", timeout_s=ABORT_S, returns=object)
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


def _raise_first_failure(pending: list[PendingCall]) -> None:
    """A call answered with a failure ends the wait for all: raise the first such."""
    for p in pending:
        if isinstance(p.reply, frames.Failure):
            _outcome(p.worker, p.command, p.reply)


def _decoded(call: LaneCall, reply: msgspec.Raw) -> Any:  # (the type the call asked for)
    try:
        return msgspec.msgpack.decode(reply, type=call.returns)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        message = f"{call.worker} answered {call.command} with a bad result: {exc}"
        raise _failure(BadResult, call.worker, call.command, message) from exc


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
