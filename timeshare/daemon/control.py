"""The control socket's server: JSON lines in, one reply per line (or a stream for `watch`).

Every connection is its own task. A line longer than the limit gets a `RequestTooLarge` reply
and the connection is closed (the rest of the line cannot be told from the next request); any
other bad line gets an error reply and the connection stays. A connection idle for longer
than `client_idle_s`, or one that does not read its replies, is closed. A bug in a handler is
answered as `InternalError` and logged: the daemon and its cycle go on. The caller's uid and
pid (SO_PEERCRED) are logged with every command.
"""

from __future__ import annotations

import os
import socket
import struct
from contextlib import suppress
from pathlib import Path

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketListener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from timeshare.config import DaemonSection
from timeshare.daemon.requests import OperatorRequests
from timeshare.daemon.service import Service
from timeshare.errors import Busy, ControlError, InvalidTransition, RequestTooLarge, SocketInUse
from timeshare.protocols.control import (
    Call,
    RequestId,
    encode_error,
    encode_event,
    encode_result,
    parse_request,
)
from timeshare.runtime import socket_is_live

log = structlog.get_logger(__name__)

SEND_TIMEOUT_S = 10.0  # a client that does not read its replies for this long is dropped
SOCKET_MODE = 0o660
DIRECTORY_MODE = 0o750


def bind_control_socket(path: Path) -> socket.socket:
    """A listening UNIX socket at `path` (0660; its directory made 0750 if this creates it).

    A socket file nobody listens on is a crashed daemon's leftover and is replaced; one that
    answers belongs to a running daemon, and this refuses to start a second.
    """
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=DIRECTORY_MODE)
        os.chmod(path.parent, DIRECTORY_MODE)  # whatever the umask
    if path.exists() or path.is_symlink():
        if socket_is_live(path):
            raise SocketInUse(f"another process listens on {path}")
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind(str(path))
        os.chmod(path, SOCKET_MODE)
        listener.listen(128)
    except BaseException:
        listener.close()
        with suppress(FileNotFoundError):
            path.unlink()
        raise
    return listener


# What the daemon answers as a refusal (the request was wrong, or not possible now), by name.
Refusal = ControlError | InvalidTransition


class ControlServer:
    def __init__(self, service: Service, requests: OperatorRequests, limits: DaemonSection) -> None:
        self.service = service
        self.requests = requests
        self.limits = limits
        self.clients = 0
        self.answering = 0  # requests being answered (not watches): an exit lets them finish
        self._all_answered = anyio.Event()

    async def wait_answered(self, timeout_s: float) -> None:
        """Until no request is being answered (the reply to `stop` goes out before the exit)."""
        with anyio.move_on_after(timeout_s):
            while self.answering:
                await self._all_answered.wait()

    async def serve(self, sock: socket.socket) -> None:
        """Accept connections until cancelled."""
        listener: SocketListener = await SocketListener.from_socket(sock)
        async with listener:
            await listener.serve(self._connection)

    async def _connection(self, stream: SocketStream) -> None:
        async with stream:
            peer = _peer_credentials(stream)
            if self.clients >= self.limits.max_clients:
                busy = f"{self.clients} clients connected; the limit is {self.limits.max_clients}"
                with suppress(anyio.BrokenResourceError, TimeoutError, OSError):
                    await self._send(stream, self._error(None, Busy(busy)))
                return
            self.clients += 1
            try:
                await self._serve_lines(stream, peer)
            except (
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                anyio.EndOfStream,
                TimeoutError,
                OSError,
            ):
                pass  # the client left, or stopped reading its replies
            except Exception:  # the server must outlive any one connection
                log.exception("control.connection.crashed", **peer)
            finally:
                self.clients -= 1

    async def _serve_lines(self, stream: SocketStream, peer: dict[str, int]) -> None:
        lines = BufferedByteReceiveStream(stream)
        while True:
            line: bytes | None = None
            limit = self.limits.max_request_bytes
            with anyio.move_on_after(self.limits.client_idle_s):
                try:
                    line = await lines.receive_until(b"\n", limit)
                except anyio.DelimiterNotFound:
                    line = b"\0" * (limit + 1)  # the rest of the line is not read
                except anyio.IncompleteRead:
                    return  # the client closed mid-line
            if line is None:
                return  # idle too long
            if len(line) > limit:  # (a line that came in one read is not cut by receive_until)
                too_large = RequestTooLarge(f"a request line is at most {limit} bytes")
                await self._send(stream, self._error(None, too_large))
                return
            if not line.strip():
                continue
            if not await self._answer(stream, line, peer):
                return

    async def _answer(self, stream: SocketStream, line: bytes, peer: dict[str, int]) -> bool:
        """Answer one line; False when the connection is done (a watch ended)."""
        try:
            call = parse_request(line)
        except ControlError as exc:
            self._count("-", exc)
            log.info("control.request.refused", error=exc.name, message=str(exc), **peer)
            await self._send(stream, self._error(exc.request_id, exc))
            return True
        log.info("control.request.received", method=call.method, id=call.id, **peer)
        if call.method == "watch":
            await self._watch(stream, call)
            return False
        self.answering += 1
        try:
            return await self._answer_call(stream, call)
        finally:
            self.answering -= 1
            if not self.answering:
                self._all_answered.set()
                self._all_answered = anyio.Event()

    async def _answer_call(self, stream: SocketStream, call: Call) -> bool:
        try:
            result = await self.requests.handle(call)
        except (ControlError, InvalidTransition) as exc:
            self._count(call.method, exc)
            await self._send(stream, self._error(call.id, exc))
            return True
        except Exception as exc:  # a bug must not take the daemon down with it
            log.exception("control.request.crashed", method=call.method)
            self.service.parts.metrics.control_requests.labels(call.method, "InternalError").inc()
            reply = encode_error(
                call.id, "InternalError", f"{type(exc).__name__}: {exc}", self._state()
            )
            await self._send(stream, reply)
            return True
        self.service.parts.metrics.control_requests.labels(call.method, "ok").inc()
        await self._send(stream, encode_result(call.id, result))
        return True

    async def _watch(self, stream: SocketStream, call: Call) -> None:
        """Stream every transition until the client leaves or falls too far behind."""
        events = self.service.subscribe()
        async with events, anyio.create_task_group() as group:

            async def until_client_leaves() -> None:
                with suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    while await stream.receive():
                        pass  # anything sent during a watch is ignored
                group.cancel_scope.cancel()

            group.start_soon(until_client_leaves)
            async for event in events:
                await self._send(stream, encode_event(call.id, event))
            group.cancel_scope.cancel()

    async def _send(self, stream: SocketStream, data: bytes) -> None:
        with anyio.fail_after(SEND_TIMEOUT_S):
            await stream.send(data)

    def _count(self, method: str, exc: Refusal) -> None:
        self.service.parts.metrics.control_requests.labels(method, type(exc).__name__).inc()

    def _error(self, request_id: RequestId, exc: Refusal) -> bytes:
        return encode_error(request_id, type(exc).__name__, str(exc), self._state())

    def _state(self) -> str:
        return self.service.state.value


def _peer_credentials(stream: SocketStream) -> dict[str, int]:
    """The connecting process's pid, uid and gid (SO_PEERCRED)."""
    raw = stream.extra(SocketAttribute.raw_socket)  # noqa: S610 - anyio, not Django
    try:
        creds = raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return {}
    pid, uid, gid = struct.unpack("3i", creds)
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}
