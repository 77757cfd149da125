"""The driver's listening end of the command lanes: what serves `WorkerLanes` (driver_side.py).

One listening UNIX socket per lane. Each worker connects once per lane and says hello first:
that connection is the worker's on that lane from then on (lane_socket.py has the framing).
Every frame that comes in is filed here: a hello and a heartbeat into the worker's `Liveness`,
a reply into the `PendingCall` it answers (whose waiter is woken). Nothing here waits for a
worker or judges one: the caller does (driver_side.py, by state/stall.py's rule).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import structlog

from timeshare.errors import ProtocolError
from timeshare.protocols.commands import frames
from timeshare.protocols.commands.cpu_wait import CpuTime
from timeshare.protocols.commands.lane_socket import DriverConnection
from timeshare.protocols.commands.processes import WorkerId
from timeshare.runtime import Endpoint

log = structlog.get_logger(__name__)

LANES = ("work", "control")
CLOSE_S = 1.0  # for closed connections to let go of their sockets
BACKLOG = 256  # connections not yet accepted: two per worker as they all start


@dataclass
class Liveness:
    """What the driver has heard of one worker: its hellos, its last heartbeat, its exit."""

    lanes: set[str] = field(default_factory=set)  # lanes that said hello
    pid: int | None = None
    heard_at: float = field(default_factory=time.monotonic)  # its last heartbeat
    busy: int | None = None  # the call its last heartbeat was about
    idle_s: float = 0.0  # how long that call had gone without progress, by the worker's clock
    # Its process tree's CPU time, as its last heartbeat said (cpu_wait.py).
    cpu_time: CpuTime = field(default_factory=lambda: CpuTime(0, 0))
    returncode: int | None = None
    why: str | None = None  # what ended it, when its exit status alone does not say
    exited: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class PendingCall:
    """A call sent and not yet answered (or answered, until its waiter takes the reply)."""

    id: int
    worker: WorkerId
    command: str
    reply: frames.Result | frames.Failure | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    wake: anyio.Event | None = None  # the waiter's, shared by the calls it waits for together

    def settle(self) -> None:
        """Answered, or its worker is gone: whoever waits for it learns it now."""
        self.done.set()
        if self.wake is not None:
            self.wake.set()


class LaneServer:
    """The lanes' sockets and connections, each worker's liveness and the calls pending."""

    def __init__(self, runtime_dir: Path) -> None:
        self.endpoints = {
            lane: Endpoint.parse(f"ipc://{runtime_dir}/{lane}.sock") for lane in LANES
        }
        self.workers: dict[WorkerId, Liveness] = {}
        self.pending: dict[int, PendingCall] = {}
        self._servers: list[asyncio.Server] = []
        self._connections: dict[DriverConnection, tuple[str, WorkerId | None]] = {}
        self._peers: dict[tuple[str, WorkerId], DriverConnection] = {}
        self._all_closed = anyio.Event()  # (set when the last connection ends)
        self._inodes: dict[str, int | None] = {}

    def liveness(self, worker: WorkerId) -> Liveness:
        """The worker's, made on first use (before it is spawned, so its hello is not missed)."""
        liveness = self.workers.get(worker)
        if liveness is None:  # (asked on every call: a Liveness is not free to make)
            liveness = self.workers[worker] = Liveness()
        return liveness

    def peer(self, lane: str, worker: WorkerId) -> DriverConnection | None:
        """The worker's connection on `lane`, if it is connected."""
        return self._peers.get((lane, worker))

    def worker_exited(self, worker: WorkerId, returncode: int, why: str | None) -> None:
        """The worker's process is gone: its liveness says so, and its calls' waiters wake."""
        liveness = self.liveness(worker)
        liveness.returncode = returncode
        liveness.why = why
        liveness.exited.set()
        for pending in self.pending.values():
            if pending.worker == worker:
                pending.settle()

    # -- sockets ------------------------------------------------------------------------------

    def bind(self) -> dict[str, socket.socket]:
        """A listening socket per lane (blocking: a stale file is probed with a connect)."""
        bound: dict[str, socket.socket] = {}
        try:
            for lane, endpoint in self.endpoints.items():
                endpoint.prepare_bind()
                sock = bound[lane] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.bind(str(endpoint.path))
                sock.listen(BACKLOG)
                self._inodes[lane] = endpoint.bound_inode()
        except BaseException:
            for sock in bound.values():
                sock.close()
            raise
        return bound

    async def serve(self, bound: dict[str, socket.socket]) -> None:
        """Serve each lane's listening socket (closed here if it cannot be)."""
        loop = asyncio.get_running_loop()
        try:
            for lane in LANES:
                sock = bound.pop(lane)

                def connection(lane: str = lane) -> DriverConnection:
                    made = DriverConnection(self._on_frame, self._on_broken, self._on_lost)
                    self._connections[made] = (lane, None)
                    return made

                try:
                    self._servers.append(await loop.create_unix_server(connection, sock=sock))
                except BaseException:
                    sock.close()
                    raise
        finally:
            for sock in bound.values():
                sock.close()

    async def close(self) -> None:
        for server in self._servers:
            server.close()  # (its listening socket: the connections are closed below)
        self._all_closed = anyio.Event()
        for connection in list(self._connections):
            connection.close()
        # A transport lets go of its socket on the loop's next turn: let it, for a moment.
        if self._connections:
            with anyio.move_on_after(CLOSE_S):
                await self._all_closed.wait()
        for lane, endpoint in self.endpoints.items():
            endpoint.remove_socket_file(self._inodes.get(lane))

    # -- what comes in ------------------------------------------------------------------------

    def _on_frame(self, connection: DriverConnection, data: bytes) -> None:
        """One frame of a connection: it is a worker's once it said hello."""
        lane, worker = self._connections[connection]
        try:
            frame = frames.decode_from_worker(data)
        except ProtocolError as exc:
            log.warning("lanes.frame.malformed", lane=lane, error=str(exc))
            return
        if isinstance(frame, frames.Hello):
            worker = WorkerId(frame.role, frame.rank)
            self._connections[connection] = (lane, worker)
            self._peers[(lane, worker)] = connection
        elif worker is None:
            log.warning("lanes.frame.before_hello", lane=lane, kind=type(frame).__name__)
            return
        self._file(lane, worker, frame)

    def _on_broken(self, connection: DriverConnection, error: ProtocolError) -> None:
        lane, worker = self._connections[connection]
        log.warning("lanes.stream.broken", lane=lane, worker=str(worker), error=str(error))

    def _on_lost(self, connection: DriverConnection) -> None:
        """A connection ended: the worker closed it or died (its exit is the process watcher's
        to report). A later connection of the same worker keeps its place."""
        lane, worker = self._connections.pop(connection, ("", None))
        if worker is not None and self._peers.get((lane, worker)) is connection:
            del self._peers[(lane, worker)]
        if not self._connections:
            self._all_closed.set()

    def _file(self, lane: str, worker: WorkerId, frame: frames.FromWorker) -> None:
        if isinstance(frame, frames.Hello):
            liveness = self.liveness(worker)
            liveness.lanes.add(frame.lane)
            liveness.pid = frame.pid
        elif isinstance(frame, frames.Heartbeat):
            liveness = self.liveness(worker)
            liveness.heard_at = time.monotonic()
            liveness.busy, liveness.idle_s = frame.busy, frame.idle_s
            liveness.cpu_time = CpuTime(frame.cpu_ran_ns, frame.cpu_wait_ns)
        else:
            pending = self.pending.get(frame.id)
            if pending is None:
                log.debug("lanes.reply.late", lane=lane, id=frame.id)  # its caller gave up
                return
            pending.reply = frame
            pending.settle()
