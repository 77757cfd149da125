"""The sender's REQ socket: request frames out, each reply checked, every wait bounded.

`WeightSender` (sender.py) decides what to send; `SenderSocket` is how it talks to the
receiver. It binds the endpoint, numbers the requests, sends each one and waits for its reply
under a deadline, and turns what comes back (or does not) into the package's errors: silence is
an `AckTimeout` naming the phase, a Failure frame a `PeerError`, an ACK for anything but the
request just sent a `ProtocolError`. It also sends the two best-effort notices that end a
session early (Abort after a failed transfer, Goodbye on close) and tears the socket down,
socket file included.
"""

from __future__ import annotations

from typing import cast

import anyio
import structlog
import zmq
import zmq.asyncio

from timeshare.errors import AckTimeout, PeerError, ProtocolError, TransferError
from timeshare.protocols.weights import frames
from timeshare.protocols.weights.frames import PROTOCOL_VERSION, Ack
from timeshare.protocols.wire import MAX_ERROR_TEXT
from timeshare.runtime import Endpoint

log = structlog.get_logger(__name__)


class SenderSocket:
    """The bound REQ socket of one session; `ack_timeout_s` bounds a send given no limit."""

    def __init__(self, endpoint: Endpoint, *, session: int, ack_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.session = session
        self._ack_timeout_s = ack_timeout_s
        self._seq = 0
        endpoint.prepare_bind()
        self._context = zmq.asyncio.Context(io_threads=1)
        self._socket = self._context.socket(zmq.REQ)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint.url)
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise TransferError(f"cannot bind weight channel {endpoint.url}: {exc}") from exc
        self._inode = endpoint.bound_inode()

    def next_seq(self) -> int:
        """The sequence number of the next request (the handshake's is 0)."""
        self._seq += 1
        return self._seq

    async def request(
        self, frame: frames.Request, step: str, limit_s: float, seq: int | None = None
    ) -> Ack:
        """Send `frame` and wait for its ACK of `step`, each within `limit_s`."""
        seq = getattr(frame, "seq", 0) if seq is None else seq
        version = getattr(frame, "version", 0)
        await self.send(frame, step, seq, limit_s)
        return await self.await_ack(seq, version, step, limit_s)

    async def send(
        self,
        frame: frames.Request,
        phase: str,
        seq: int,
        limit_s: float | None = None,
        *,
        bucket: int | None = None,
    ) -> None:
        # A REQ send waits for a connected peer; bounded like every other wait.
        with anyio.move_on_after(limit_s or self._ack_timeout_s) as scope:
            await self._socket.send(frames.encode(frame))
        if scope.cancelled_caught:
            raise self._timeout(phase, seq, "sending", bucket)

    async def await_ack(
        self, seq: int, version: int, step: str, limit_s: float, *, bucket: int | None = None
    ) -> Ack:
        """The receiver's ACK of request `seq`; anything else it may answer is raised."""
        with anyio.move_on_after(limit_s) as scope:
            data = await self._socket.recv()
        if scope.cancelled_caught:
            raise self._timeout(step, seq, f"waiting {limit_s:g} s for the receiver's ACK", bucket)
        reply = frames.decode_reply(data)
        if isinstance(reply, frames.Failure):
            raise PeerError(
                f"receiver at {self.endpoint.url} failed ({step}, seq {seq}): "
                f"{reply.type}: {reply.message}",
                remote_type=reply.type,
                remote_message=reply.message,
            )
        if (reply.session, reply.seq, reply.version, reply.step) != (
            self.session,
            seq,
            version,
            step,
        ):
            raise ProtocolError(
                f"unexpected ACK from {self.endpoint.url}: got session {reply.session:x} "
                f"seq {reply.seq} version {reply.version} step {reply.step}, expected session "
                f"{self.session:x} seq {seq} version {version} step {step}"
            )
        return reply

    def _timeout(self, phase: str, seq: int, doing: str, bucket: int | None) -> AckTimeout:
        where = f"bucket {bucket}, seq {seq}" if bucket is not None else f"seq {seq}"
        return AckTimeout(
            f"weight channel {self.endpoint.url}: no answer in phase {phase} ({where}) "
            f"while {doing}; session closed",
            phase=phase,
            seq=seq,
            endpoint=self.endpoint.url,
            bucket=bucket,
        )

    # -- ending a session -------------------------------------------------------------------

    async def send_abort_notice(self, version: int, reason: str) -> None:
        """Tell a receiver still listening that the transfer is given up; the caller bounds it."""
        if not self._idle():
            await self._socket.recv()  # the reply to the header still in flight
        seq = self.next_seq()
        notice = frames.Abort(PROTOCOL_VERSION, self.session, version, seq, reason[:MAX_ERROR_TEXT])
        await self._socket.send(frames.encode(notice))
        await self._socket.recv()

    def say_goodbye(self) -> bool:
        """Best effort, never blocks: lets a receiver waiting for the next transfer stop at once."""
        goodbye = frames.encode(frames.Goodbye(PROTOCOL_VERSION, self.session))
        blocking_view: zmq.Socket[bytes] = zmq.Socket.shadow(self._socket.underlying)
        try:
            blocking_view.send(goodbye, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            log.debug("sync.goodbye.skipped", endpoint=self.endpoint.url, reason="peer gone")
            return False
        return True

    def close(self, *, linger_s: float) -> None:
        """Close the socket (with linger_s 0 nothing waits, not even term()); remove its file."""
        self._socket.close(linger=int(linger_s * 1000))
        self._context.term()
        self.endpoint.remove_socket_file(self._inode)

    def _idle(self) -> bool:
        """Whether REQ may send now (no header is awaiting its reply)."""
        return bool(cast(int, self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLOUT)
