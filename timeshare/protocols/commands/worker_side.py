"""The worker's end of the command lanes: runs calls from the work lane, answers the control lane.

The work lane runs one call at a time in the main thread (train_step, sync, generate: these may
take minutes). The control lane has its own thread and socket, so it answers `status` and
`abort` while work runs, and it sends a heartbeat every `heartbeat_s` carrying a progress count
that the engine raises with `report_progress()`, and how long the running call has gone without
progress, by this process's clock: the driver calls a worker stalled on what the worker says, so
a driver that was itself held up blames no one for the time it did not watch. The rule, and the
machine's time left out of idleness (the process held up, its threads waiting for a CPU), is
state/stall.py's; cpu_wait.py measures the wait.

`abort` interrupts the running call by a signal to the main thread: a call waiting in Python
(sleeping, waiting on a lock or an event, polling) ends at once with `Aborted`. A call stuck inside
C code is not interruptible; the driver's stall detector sees it and kills the process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NamedTuple, TypeAlias

import msgspec
import structlog

from timeshare import logs
from timeshare.errors import Aborted, ProtocolError, UnknownCommand
from timeshare.protocols.commands import frames, params
from timeshare.protocols.commands.cpu_wait import CpuTime, cpu_wait_between, cpus, tree_cpu_time
from timeshare.protocols.commands.lane_socket import WorkerSocket
from timeshare.protocols.commands.results import WorkerStatus
from timeshare.runtime import Endpoint
from timeshare.state.stall import call_idle_s, held_up_s, machine_time_s

log = structlog.get_logger(__name__)

# A command's handler: its params as the call carried them (it decodes them with its own type:
# params.py), and what it returns, encoded as the call's result.
Handler: TypeAlias = Callable[[msgspec.Raw], object]
ABORT_SIGNAL = signal.SIGUSR1
POLL_SLICE_S = 0.05
CONNECT_S = 10.0  # the driver listens before it starts a worker: this is for a slow start
SHUTDOWN = "shutdown"  # answered at once, or after the worker's own `shutdown` handler ran


class Reading(NamedTuple):
    """What the control thread read at a heartbeat: when, its process tree's CPU time
    (cpu_wait.py), and how long it had been held up so far (state/stall.py's `held_up_s`)."""

    at: float
    cpu: CpuTime
    held_s: float


class WorkerServer:
    """Serves one worker's two lanes. `serve()` must run in the process's main thread."""

    def __init__(
        self,
        *,
        work_endpoint: str,
        control_endpoint: str,
        role: str,
        rank: int,
        handlers: dict[str, Handler],
        heartbeat_s: float = 0.5,
    ) -> None:
        self.role = role
        self.rank = rank
        self._handlers = handlers
        self._heartbeat_s = heartbeat_s
        self._endpoints = {"work": work_endpoint, "control": control_endpoint}
        self._progress = 0
        self._progress_at = time.monotonic()  # the running call's last progress (or start)
        # The control thread's: its last reading, the one its stretch since that progress is
        # measured from (its first after it), and the machine's time in that stretch.
        self._reading = self._stretch = Reading(time.monotonic(), CpuTime(0, 0), 0.0)
        self._machine_s = 0.0
        self._waiting = False
        self._busy: frames.Call | None = None
        self._armed = False  # an abort signal may raise Aborted now
        self._abort_instead: Callable[[], object] | None = None  # see aborting_with
        self._stop = threading.Event()
        self._parent = os.getppid()

    def report_progress(self) -> None:
        """Called by the engine as it makes progress (a batch generated, a bucket loaded)."""
        self._progress += 1
        self._mark_progress()

    def _mark_progress(self) -> None:
        self._progress_at = time.monotonic()

    @contextmanager
    def waiting_on_peer(self) -> Iterator[None]:
        """Mark a wait on the peer worker (whose own deadlines bound it): not a stall of ours.

        Without this, a worker blocked on a hung peer would be blamed for the peer's stall.
        """
        self._waiting = True
        try:
            yield
        finally:
            # The wait was progress, up to its end: noted before the flag drops, so that no
            # heartbeat between the two says the whole wait was idle (_heartbeat reads the flag
            # first).
            self._mark_progress()
            self._waiting = False

    @contextmanager
    def aborting_with(self, abort: Callable[[], object]) -> Iterator[None]:
        """While inside, the driver's abort calls `abort` instead of raising `Aborted` where the
        main thread stands. For a call that runs an event loop on the main thread: an exception
        raised inside the loop's own machinery would leave the loop broken, so `abort` only
        schedules the cancellation of what the loop runs (it is called from a signal handler)."""
        self._abort_instead = abort
        try:
            yield
        finally:
            self._abort_instead = None

    def serve(self) -> None:
        """Answer work calls until `shutdown` or until the parent process (the zygote that forked
        this worker, or whoever started it) is gone."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("WorkerServer.serve() must run in the main thread (abort signal)")
        previous = signal.signal(ABORT_SIGNAL, self._on_abort_signal)
        work = self._connect("work")
        control = threading.Thread(target=self._control_loop, name="control-lane", daemon=True)
        control.start()
        try:
            self._work_loop(work)
        finally:
            self._stop.set()
            control.join(timeout=5.0)
            work.close()
            signal.signal(ABORT_SIGNAL, previous)

    # -- work lane ----------------------------------------------------------------------------

    def _work_loop(self, work: WorkerSocket) -> None:
        try:
            while os.getppid() == self._parent:
                data = work.receive(POLL_SLICE_S)
                if data is None:
                    continue
                try:
                    call = frames.decode_to_worker(data)
                except ProtocolError as exc:
                    log.warning(
                        "worker.call.malformed", role=self.role, rank=self.rank, error=str(exc)
                    )
                    continue
                reply = self._execute(call)
                if call.command == SHUTDOWN:
                    self._stop.set()  # the driver closes the lanes once it has the answer
                work.send(frames.encode(reply))
                if call.command == SHUTDOWN:
                    return
        except (ConnectionError, ProtocolError) as exc:  # the driver is gone, or broke the lane
            log.warning("worker.lane.lost", role=self.role, rank=self.rank, error=str(exc))
            return
        log.warning("worker.driver.gone", role=self.role, rank=self.rank)

    def _execute(self, call: frames.Call) -> frames.Result | frames.Failure:
        try:
            return self._run(call)
        except Aborted as exc:  # the signal came between the handler's end and the disarm
            return frames.failure(call.id, exc)

    def _run(self, call: frames.Call) -> frames.Result | frames.Failure:
        if call.command == SHUTDOWN and SHUTDOWN not in self._handlers:
            return frames.result(call.id, None)
        handler = self._handlers.get(call.command)
        if handler is None:
            return frames.failure(call.id, UnknownCommand(f"no handler for {call.command!r}"))
        self._mark_progress()
        self._busy = call
        try:
            self._armed = True
            value = handler(call.params)
            self._armed = False
            return frames.result(call.id, value)
        except Aborted as exc:  # the driver gave up on this call: say where it was stuck
            self._armed = False
            log.warning("worker.call.aborted", command=call.command, exc_info=True)
            return frames.failure(call.id, exc)
        except Exception as exc:
            self._armed = False
            return frames.failure(call.id, exc)
        finally:
            self._armed = False
            self._busy = None

    def _on_abort_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            self._armed = False  # at most one Aborted per call
            if self._abort_instead is not None:
                self._abort_instead()
                return
            raise Aborted(f"{self._busy.command if self._busy else 'call'} aborted by the driver")

    # -- control lane -------------------------------------------------------------------------

    def _control_loop(self) -> None:
        try:
            control = self._connect("control")
        except ConnectionError as exc:  # the work lane connected: the driver went meanwhile
            log.warning("worker.lane.lost", role=self.role, rank=self.rank, error=str(exc))
            return
        held_s = 0.0  # all the time this thread was held up
        self._reading = self._stretch = self._read(held_s)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                wait_s = min(POLL_SLICE_S, max(0.0, next_beat - time.monotonic()))
                waiting_since = time.monotonic()
                data = control.receive(wait_s)
                held_s += held_up_s(time.monotonic() - waiting_since, wait_s)
                if data is not None:
                    self._answer_control(control, data)
                if time.monotonic() >= next_beat:
                    self._measure(self._read(held_s))
                    control.send(frames.encode(self._heartbeat()))
                    next_beat = time.monotonic() + self._heartbeat_s
        except (ConnectionError, ProtocolError) as exc:  # the work loop sees the same and ends
            if not self._stop.is_set():
                log.warning("worker.lane.lost", role=self.role, rank=self.rank, error=str(exc))
        finally:
            control.close()

    def _read(self, held_s: float) -> Reading:
        return Reading(time.monotonic(), tree_cpu_time(os.getpid()), held_s)

    def _measure(self, reading: Reading) -> None:
        """The machine's time in the stretch since the running call's last progress, as of
        `reading` (state/stall.py). Judged over the whole stretch, from the first reading after
        that progress (the machine's time before that reading, a beat's at most, counts as the
        call's; a pause before the progress does not count for the call after it): the kernel
        counts a wait for a CPU once it has ended, so stretches cut at every heartbeat, each
        capped at its own length, would lose the waits counted late."""
        if self._progress_at > self._reading.at:  # progress since the last reading
            self._stretch = reading
        stretch, self._reading = self._stretch, reading
        stretch_s = reading.at - stretch.at
        cpu_wait_s = cpu_wait_between(stretch.cpu, reading.cpu, stretch_s, cpus(os.getpid()))
        self._machine_s = machine_time_s(stretch_s, reading.held_s - stretch.held_s, cpu_wait_s)

    def _answer_control(self, control: WorkerSocket, data: bytes) -> None:
        try:
            call = frames.decode_to_worker(data)
        except ProtocolError as exc:
            log.warning("worker.control.malformed", role=self.role, rank=self.rank, error=str(exc))
            return
        if call.command == "abort":
            reply: frames.Result | frames.Failure = frames.result(call.id, self._abort())
        elif call.command == "status":
            reply = frames.result(call.id, self._status())
        elif call.command == "log_level":
            reply = self._set_log_level(call)
        else:
            reply = frames.failure(call.id, UnknownCommand(f"no control command {call.command!r}"))
        control.send(frames.encode(reply))

    def _set_log_level(self, call: frames.Call) -> frames.Result | frames.Failure:
        """The operator's level, while work runs; an unknown one refused naming the levels."""
        try:
            level = params.decode(call.params, params.LogLevelParams, call.command).level
            if level not in logs.LEVELS:
                raise ValueError(f"no log level {level!r} (one of {', '.join(logs.LEVELS)})")
        except (ProtocolError, ValueError) as exc:
            return frames.failure(call.id, exc)
        logs.set_level(level)
        log.info("worker.log_level.set", level=level)
        return frames.result(call.id, level)

    def _abort(self) -> str | None:
        busy = self._busy
        if busy is not None and self._armed:
            signal.pthread_kill(threading.main_thread().ident or 0, ABORT_SIGNAL)
            return busy.command
        return None

    def _status(self) -> WorkerStatus:
        busy = self._busy
        return WorkerStatus(
            role=self.role,
            rank=self.rank,
            pid=os.getpid(),
            busy=None if busy is None else busy.command,
            progress=self._progress,
        )

    def _heartbeat(self, now: float | None = None) -> frames.Heartbeat:
        """The heartbeat as of `now` (a test's; the clock's by default)."""
        busy = self._busy
        waiting = self._waiting
        idle_s = call_idle_s(
            time.monotonic() if now is None else now,
            self._progress_at,
            self._machine_s,
            busy=busy is not None,
            waiting=waiting,
        )
        return frames.Heartbeat(
            None if busy is None else busy.id,
            None if busy is None else busy.command,
            self._progress,
            waiting,
            idle_s,
            self._reading.cpu.waited_ns,
            self._reading.cpu.ran_ns,
        )

    def _connect(self, lane: str) -> WorkerSocket:
        """The lane's socket, having said who this is (the driver knows a lane by its hello)."""
        path = Endpoint.parse(self._endpoints[lane]).path
        if path is None:
            raise ValueError(f"a command lane is a UNIX socket: {self._endpoints[lane]!r}")
        socket = WorkerSocket(str(path), connect_timeout_s=CONNECT_S)
        socket.send(frames.encode(frames.Hello(self.role, self.rank, os.getpid(), lane)))
        return socket
