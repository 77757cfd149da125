"""The receiver's REP socket: each request in, checked, and answered exactly once.

`WeightReceiver` (receiver.py) decides what a request means for the transfer; `ReceiverSocket` is
how it talks to the sender. It connects to the endpoint it was given (the receiver may start before
the sender binds) and waits there for an invitation; joining a session means answering it, leaving
that endpoint for good and connecting to the socket the sender bound for the session alone
(sender_socket.py says why). It reads and decodes each request, checks that it belongs to this
session and comes in sequence, and answers it: an ACK once its work is done, or a Failure frame
naming the exception before that exception is raised on this side. REP alternates strictly, so
every request read is answered on every path, and a Goodbye or an Abort from the sender is answered
before it ends the session here. It is blocking: the receiver runs in an engine worker, or in a
worker thread under `receive_async`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import structlog
import zmq

from timeshare.errors import AckTimeout, PeerClosed, ProtocolError, TransferError
from timeshare.protocols.weights import frames
from timeshare.protocols.weights.frames import PROTOCOL_VERSION
from timeshare.runtime import Endpoint

log = structlog.get_logger(__name__)

RECONNECT_IVL_MS = 50
# How long the rendezvous socket, closed right after answering an invitation, keeps trying to
# deliver that answer (a few ms when the sender is alive; it waits for it). close() may wait
# this long, whatever linger_s is, when the sender died in between.
JOIN_LINGER_MS = 1000


class ReceiverSocket:
    """The connected REP socket of one session; `session` is None until it joined one."""

    def __init__(
        self, endpoint: Endpoint, *, linger_s: float, member: int = 0, members: int = 1
    ) -> None:
        self.endpoint = endpoint
        self.member = member
        self.members = members
        self.session: int | None = None
        self.last_seq = 0
        self._linger_ms = int(linger_s * 1000)
        self._context = zmq.Context(io_threads=1)
        try:
            self._socket = self._connect(endpoint)
        except BaseException:
            self._context.term()
            raise

    def join(self, invite: frames.Invite) -> bool:
        """Join the session `invite` offers: connect to its socket, answer, leave the endpoint.

        False when the invitation is stale (a sender that has gone since left it queued here):
        it is answered with a Failure (which a later sender's REQ drops as not its own) and
        this socket stays at the endpoint for the next one.
        """
        if (invite.member, invite.members) != (self.member, self.members):
            self.fail(
                invite,
                ProtocolError(
                    f"invitation for receiver {invite.member} of {invite.members}, this one is "
                    f"receiver {self.member} of {self.members} (sender and engine disagree on "
                    "the tensor-parallel size)"
                ),
            )
        try:
            session_endpoint = self.endpoint.session_socket(invite.session, invite.port)
            session_endpoint.check_connectable()
        except TransferError as exc:
            self.fail(invite, ProtocolError(f"invitation to no usable socket: {exc}"))
        if not session_endpoint.is_live():
            stale = PeerClosed(f"session {invite.session:x} is gone ({session_endpoint.url})")
            self._send_reply(frames.failure_for(stale, session=invite.session, version=0, seq=0))
            log.info("sync.invitation.stale", endpoint=self.endpoint.url, error=str(stale))
            return False
        try:
            # Never reconnecting: once its sender is gone, nothing bound there later (a port
            # reused, a rebuilt sender) can reach this receiver.
            session_socket = self._connect(session_endpoint, reconnect=False)
        except BaseException as exc:
            error = TransferError(f"cannot connect to {session_endpoint.url}: {exc}")
            error.__cause__ = exc
            self.fail(invite, error)
        self._send_reply(frames.Ack(PROTOCOL_VERSION, invite.session, "joined", 0, 0))
        rendezvous, self._socket = self._socket, session_socket
        # The answer must still go out, whatever linger_s says: the sender waits for it.
        rendezvous.close(linger=JOIN_LINGER_MS)
        self.session = invite.session
        self.last_seq = 0
        return True

    def poll(self, limit_s: float) -> bool:
        """Whether a request is waiting, after at most `limit_s`."""
        return bool(self._socket.poll(int(limit_s * 1000) + 1, zmq.POLLIN))

    def read_request(self) -> frames.Request:
        """The waiting request, checked; a Goodbye or an Abort is answered, then raised."""
        data = self._socket.recv()
        try:
            frame = frames.decode_request(data)
        except ProtocolError as exc:
            self._send_reply(frames.failure_for(exc, session=self.session or 0, version=0, seq=0))
            raise
        self._check_session(frame)
        if isinstance(frame, frames.Goodbye):
            self._send_reply(frames.Ack(PROTOCOL_VERSION, frame.session, "goodbye", 0, 0))
            raise PeerClosed(f"sender at {self.endpoint.url} closed the session")
        if isinstance(frame, frames.Abort):
            self._send_reply(
                frames.Ack(PROTOCOL_VERSION, frame.session, "aborted", frame.version, frame.seq)
            )
            raise TransferError(
                f"sender aborted the transfer of version {frame.version}: {frame.reason}"
            )
        return frame

    def silence(self, phase: str, timeout: float, bucket: int | None) -> AckTimeout:
        """The error for a sender that sent nothing for `timeout` seconds."""
        waiting_for = "" if bucket is None else f"bucket {bucket}, "
        return AckTimeout(
            f"weight channel {self.endpoint.url}: no frame from the sender in phase "
            f"{phase} ({waiting_for}after seq {self.last_seq}) within {timeout:g} s; "
            "session closed",
            phase=phase,
            seq=self.last_seq,
            endpoint=self.endpoint.url,
            bucket=bucket,
        )

    def check_bucket(self, bucket: frames.Bucket, version: int, index: int, buffers: int) -> None:
        """A bucket must come in order and name one of the session's `buffers`."""
        self.check_version(bucket, version)
        if bucket.index != index or not 0 <= bucket.buffer < buffers:
            self.fail(
                bucket,
                ProtocolError(
                    f"bucket {bucket.index} in buffer {bucket.buffer}, expected bucket {index} "
                    f"in one of {buffers} buffers"
                ),
            )

    def check_version(
        self, frame: frames.Bucket | frames.Release | frames.Finalize, version: int
    ) -> None:
        if frame.version != version:
            self.fail(
                frame,
                ProtocolError(f"weight version changed mid-transfer: {version} -> {frame.version}"),
            )

    def reply_to(
        self, frame: frames.Request, work: Callable[[], None], *, step: frames.AckStep
    ) -> None:
        """Do `work` for a request, then ACK it; on failure send a Failure frame and re-raise."""
        try:
            work()
        except BaseException as exc:
            self.fail(frame, exc)
        version = getattr(frame, "version", 0)
        seq = getattr(frame, "seq", 0)
        self._send_reply(frames.Ack(PROTOCOL_VERSION, frame.session, step, version, seq))

    def fail(self, frame: frames.Request, exc: BaseException) -> NoReturn:
        """Answer `frame` with a Failure naming `exc`, then raise `exc` here."""
        failure = frames.failure_for(
            exc,
            session=frame.session,
            version=getattr(frame, "version", 0),
            seq=getattr(frame, "seq", 0),
        )
        self._send_reply(failure)
        raise exc

    def close(self) -> None:
        """Close the socket; a reply still queued goes out within the linger it was made with."""
        try:
            self._socket.close()
        finally:
            self._context.term()

    def _connect(self, endpoint: Endpoint, *, reconnect: bool = True) -> zmq.Socket[bytes]:
        socket = self._context.socket(zmq.REP)
        try:
            socket.setsockopt(zmq.LINGER, self._linger_ms)
            socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS if reconnect else -1)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            socket.connect(endpoint.url)
        except BaseException:
            socket.close(linger=0)
            raise
        return socket

    def _check_session(self, frame: frames.Request) -> None:
        if isinstance(frame, frames.Invite):
            if self.session is not None:
                self.fail(frame, ProtocolError("invitation on an established session"))
            return
        if frame.session != self.session:
            self.fail(
                frame,
                ProtocolError(
                    f"frame of session {frame.session:x}, this session is "
                    f"{'none yet' if self.session is None else f'{self.session:x}'}"
                ),
            )
        seq = getattr(frame, "seq", None)
        if seq is not None:
            if seq <= self.last_seq:
                self.fail(frame, ProtocolError(f"sequence went back: {seq} after {self.last_seq}"))
            self.last_seq = seq

    def _send_reply(self, reply: frames.Reply) -> None:
        # REP holds an outstanding request whenever this runs, so the send does not block.
        try:
            self._socket.send(frames.encode(reply), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Never replaces the error being reported; the sender's deadline covers a lost reply.
            log.warning("sync.reply.lost", endpoint=self.endpoint.url, error=repr(exc))
