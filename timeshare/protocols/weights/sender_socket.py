"""The sender's REQ sockets: the invitation, then request frames out, each reply checked.

`WeightSender` (sender.py) decides what to send; `SenderSocket` is how it talks to the
receiver. It binds two sockets. The endpoint both sides were given is only a rendezvous: one
Invite goes out there, naming a socket bound for this session alone, and the receiver that
answers it leaves the rendezvous and connects to that one. A REQ socket hands each request to
whichever connected peer is next, so the rendezvous may reach any receiver waiting on the
endpoint; the session's socket reaches the one that joined, and no other ever knows it exists.
A receiver whose session died (its sender gone, itself still stuck in an engine) can thus never
be handed a frame of the next session on the same endpoint.

On the session's socket it numbers the requests, sends each one and waits for its reply under a
deadline, and turns what comes back (or does not) into the package's errors: silence is an
`AckTimeout` naming the phase and the bound that was armed, a Failure frame a `PeerError`, an
ACK for anything but the request just sent a `ProtocolError`. It also sends the two
best-effort notices that end a session early (Abort after a failed transfer, Goodbye on close)
and tears both sockets down, socket files included.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, cast

import anyio
import anyio.lowlevel
import structlog
import zmq
import zmq.asyncio

from timeshare.errors import AckTimeout, PeerError, ProtocolError, TransferError
from timeshare.protocols.weights import frames
from timeshare.protocols.weights.frames import PROTOCOL_VERSION, Ack
from timeshare.protocols.wire import MAX_ERROR_TEXT
from timeshare.runtime import Endpoint

log = structlog.get_logger(__name__)


class _Bound(NamedTuple):
    socket: zmq.asyncio.Socket
    endpoint: Endpoint  # as bound: a tcp port asked as 0 or * is the real one here
    inode: int | None  # of the socket file this side created (ipc)


class SenderSocket:
    """The bound REQ sockets of one session's receiver (`member` of `members`: members.py);
    `ack_timeout_s` bounds a send given no limit."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        session: int,
        ack_timeout_s: float,
        member: int = 0,
        members: int = 1,
    ) -> None:
        self.session = session
        self.member = member
        self.members = members
        self.joined = False  # a receiver answered the invitation
        self._ack_timeout_s = ack_timeout_s
        self._seq = 0
        self._context = zmq.asyncio.Context(io_threads=1)
        bound: list[_Bound] = []
        try:
            bound.append(self._bind(endpoint))
            bound.append(self._bind(bound[0].endpoint.session_socket(session)))
        except BaseException:
            for each in bound:
                _close(each)
            self._context.term()
            raise
        self._rendezvous, self._session_socket = bound
        self._socket = self._session_socket.socket  # every request after the invitation

    @property
    def endpoint(self) -> Endpoint:
        """The rendezvous, as bound (receivers connect here)."""
        return self._rendezvous.endpoint

    @property
    def session_endpoint(self) -> Endpoint:
        return self._session_socket.endpoint

    @property
    def who(self) -> str:
        """The receiver, as errors name it: its endpoint, and which member when there are
        several (a tensor-parallel worker)."""
        if self.members == 1:
            return f"receiver at {self.endpoint.url}"
        return f"receiver {self.member} of {self.members} at {self.endpoint.url}"

    def next_seq(self) -> int:
        """The sequence number of the next request (the handshake's is 0)."""
        self._seq += 1
        return self._seq

    async def invite(self, limit_s: float) -> None:
        """Send the invitation on the rendezvous and wait until a receiver has joined."""
        port = self.session_endpoint.port or 0
        invite = frames.Invite(PROTOCOL_VERSION, self.session, port, self.member, self.members)
        socket = self._rendezvous.socket
        took = "no receiver took the invitation"
        await self._send_on(socket, invite, phase="joined", seq=0, limit_s=limit_s, why=took)
        why = "the receiver did not answer"
        data = await self._recv_on(socket, phase="joined", seq=0, limit_s=limit_s, why=why)
        self._checked(frames.decode_reply(data), 0, 0, "joined")
        self.joined = True

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
        why = "no receiver connected to the session"
        limit_s = limit_s or self._ack_timeout_s
        await self._send_on(
            self._socket, frame, phase=phase, seq=seq, limit_s=limit_s, why=why, bucket=bucket
        )

    async def await_ack(
        self, seq: int, version: int, step: str, limit_s: float, *, bucket: int | None = None
    ) -> Ack:
        """The receiver's ACK of request `seq`; anything else it may answer is raised."""
        why = "waiting for the receiver's ACK"
        data = await self._recv_on(
            self._socket, phase=step, seq=seq, limit_s=limit_s, why=why, bucket=bucket
        )
        return self._checked(frames.decode_reply(data), seq, version, step)

    async def _send_on(
        self,
        socket: zmq.asyncio.Socket,
        frame: frames.Request,
        *,
        phase: str,
        seq: int,
        limit_s: float,
        why: str,
        bucket: int | None = None,
    ) -> None:
        # A REQ send waits for a connected peer; bounded like every other wait.
        with anyio.move_on_after(limit_s) as scope:
            await socket.send(frames.encode(frame))
        if scope.cancelled_caught:
            raise self._timeout(phase, seq, limit_s, why, bucket)

    async def _recv_on(
        self,
        socket: zmq.asyncio.Socket,
        *,
        phase: str,
        seq: int,
        limit_s: float,
        why: str,
        bucket: int | None = None,
    ) -> bytes:
        with anyio.move_on_after(limit_s) as scope:
            while True:
                try:
                    return await socket.recv()
                except zmq.Again:
                    # REQ_CORRELATE dropped an answer to another request (a stale receiver's
                    # to an invitation of a sender before this one) after the poll saw it.
                    await anyio.lowlevel.checkpoint()
        assert scope.cancelled_caught
        raise self._timeout(phase, seq, limit_s, why, bucket)

    def _checked(self, reply: frames.Reply, seq: int, version: int, step: str) -> Ack:
        if isinstance(reply, frames.Failure):
            raise PeerError(
                f"{self.who} failed ({step}, seq {seq}): {reply.type}: {reply.message}",
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
                f"unexpected ACK from {self.who}: got session {reply.session:x} "
                f"seq {reply.seq} version {reply.version} step {reply.step}, expected session "
                f"{self.session:x} seq {seq} version {version} step {step}"
            )
        return reply

    def _timeout(
        self, phase: str, seq: int, limit_s: float, why: str, bucket: int | None = None
    ) -> AckTimeout:
        """The error for a wait of `limit_s` that ended without an answer."""
        where = f"bucket {bucket}, seq {seq}" if bucket is not None else f"seq {seq}"
        member = "" if self.members == 1 else f" from receiver {self.member} of {self.members}"
        return AckTimeout(
            f"weight channel {self.endpoint.url}: no answer in phase {phase} ({where}){member} "
            f"within {limit_s:g} s, {why}; session closed",
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

    def say_goodbye(self, limit_s: float) -> None:
        """Best effort, blocks at most `limit_s`: lets a receiver waiting for the next transfer
        stop at once. Waits for its answer: the receiver's session socket never reconnects, so
        libzmq drops what it had not read yet when this side closes (a goodbye merely sent
        would often be lost)."""
        goodbye = frames.encode(frames.Goodbye(PROTOCOL_VERSION, self.session))
        blocking_view: zmq.Socket[bytes] = zmq.Socket.shadow(self._socket.underlying)
        try:
            blocking_view.send(goodbye, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            log.debug("sync.goodbye.skipped", endpoint=self.endpoint.url, reason="peer gone")
            return
        if blocking_view.poll(int(limit_s * 1000), zmq.POLLIN):
            blocking_view.recv(flags=zmq.NOBLOCK)  # its "goodbye" ACK: nothing to check
        else:
            log.debug("sync.goodbye.unanswered", endpoint=self.endpoint.url, limit_s=limit_s)

    def close(self) -> None:
        """Close both sockets and remove their files, whatever closing raised; nothing waits
        (no linger), not even term()."""
        try:
            _close(self._session_socket)
        finally:
            try:
                _close(self._rendezvous)
            finally:
                self._context.term()

    def _bind(self, endpoint: Endpoint) -> _Bound:
        endpoint.prepare_bind()
        socket = self._context.socket(zmq.REQ)
        inode = None
        try:
            socket.setsockopt(zmq.LINGER, 0)
            # A reply to an older request (a stale receiver answering an invitation that a
            # sender before this one sent to the endpoint) is dropped, not taken for ours.
            socket.setsockopt(zmq.REQ_CORRELATE, 1)
            try:
                socket.bind(endpoint.url)
            except zmq.ZMQError as exc:
                raise TransferError(f"cannot bind weight channel {endpoint.url}: {exc}") from exc
            inode = endpoint.bound_inode()
            if endpoint.path is None:  # tcp: the port libzmq chose when asked for any
                last = cast(bytes, socket.getsockopt(zmq.LAST_ENDPOINT)).decode()
                endpoint = Endpoint.parse(last)
        except BaseException:
            socket.close(linger=0)
            endpoint.remove_socket_file(inode)
            raise
        return _Bound(socket, endpoint, inode)

    def _idle(self) -> bool:
        """Whether REQ may send now (no header is awaiting its reply)."""
        return bool(cast(int, self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLOUT)


def _close(bound: _Bound) -> None:
    try:
        bound.socket.close(linger=0)
    finally:
        with contextlib.suppress(OSError):
            bound.endpoint.remove_socket_file(bound.inode)
