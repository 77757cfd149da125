"""The receivers of one session: every request to all of them, every reply from all of them.

A rollout engine with tensor parallelism N loads each weight in N worker processes, each its
own shard. The sender packs each bucket once into staging that all N map; `SessionMembers`
holds one `SenderSocket` (sender_socket.py) per receiver, member k invited at the endpoint's
member k (`Endpoint.member`), and gives `WeightSender` the interface of one socket:

- a request goes to every member under one sequence number, and is answered when every
  member has ACKed it: a bucket's buffer is reused, RELEASED and FINALIZED reached, only once
  all N have answered;
- the first member to fail (a Failure frame, silence past its deadline, a wrong ACK) ends the
  wait for the others at once and is raised as itself, naming that member (`failed` keeps which);
  the others, still listening, are told the transfer is aborted (`send_abort_notice`).

One member is today's wire and speed: its requests are awaited directly, with no task group.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import structlog
import zmq

from timeshare.errors import TransferError
from timeshare.protocols.weights import frames
from timeshare.protocols.weights.sender_socket import SenderSocket
from timeshare.runtime import Endpoint

log = structlog.get_logger(__name__)
T = TypeVar("T")


class SessionMembers:
    """The bound sockets of a session's `members` receivers; `ack_timeout_s` bounds a send
    given no limit."""

    def __init__(
        self, endpoint: Endpoint, *, session: int, ack_timeout_s: float, members: int
    ) -> None:
        if members < 1:
            raise TransferError(f"a weight session needs at least one receiver, got {members}")
        self.session = session
        self.failed: int | None = None  # the member whose failure ended the session
        self._seq = 0
        self._closed = False
        self._sockets: list[SenderSocket] = []
        try:
            for member in range(members):
                self._sockets.append(
                    SenderSocket(
                        endpoint.member(member),
                        session=session,
                        ack_timeout_s=ack_timeout_s,
                        member=member,
                        members=members,
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def members(self) -> int:
        return len(self._sockets)

    @property
    def joined(self) -> bool:
        """Whether any receiver answered its invitation (one may be waiting to be told)."""
        return any(socket.joined for socket in self._sockets)

    @property
    def endpoint(self) -> Endpoint:
        """The rendezvous of member 0, as bound: the endpoint the session was given."""
        return self._sockets[0].endpoint

    @property
    def session_endpoint(self) -> Endpoint:
        return self._sockets[0].session_endpoint

    def next_seq(self) -> int:
        """The sequence number of the next request, the same at every member."""
        self._seq += 1
        for socket in self._sockets:
            socket.next_seq()
        return self._seq

    async def invite(self, limit_s: float) -> None:
        """Invite every member; returns once all have joined, each within `limit_s`."""
        await self._each(lambda socket: socket.invite(limit_s))

    async def request(
        self, frame: frames.Request, step: str, limit_s: float, seq: int | None = None
    ) -> None:
        """Send `frame` to every member and wait for each one's ACK of `step`."""
        await self._each(lambda socket: socket.request(frame, step, limit_s, seq))

    async def send(
        self,
        frame: frames.Request,
        phase: str,
        seq: int,
        limit_s: float | None = None,
        *,
        bucket: int | None = None,
    ) -> None:
        await self._each(lambda socket: socket.send(frame, phase, seq, limit_s, bucket=bucket))

    async def await_ack(
        self, seq: int, version: int, step: str, limit_s: float, *, bucket: int | None = None
    ) -> None:
        """Every member's ACK of request `seq`; the first failure is raised."""
        await self._each(
            lambda socket: socket.await_ack(seq, version, step, limit_s, bucket=bucket)
        )

    async def send_abort_notice(self, version: int, reason: str) -> None:
        """Tell every member that joined, but the one that failed, that the transfer is given
        up; best effort (a member that cannot be told is logged); the caller bounds it."""

        async def tell(socket: SenderSocket) -> None:
            try:
                await socket.send_abort_notice(version, reason)
            except (TransferError, zmq.ZMQError) as exc:
                log.warning("sync.abort.notice_failed", receiver=socket.who, error=repr(exc))

        listening = [
            socket for socket in self._sockets if socket.joined and socket.member != self.failed
        ]
        async with anyio.create_task_group() as group:
            for socket in listening:
                group.start_soon(tell, socket)

    def say_goodbye(self, limit_s: float) -> None:
        """Best effort, at most `limit_s` for each member that joined."""
        for socket in self._sockets:
            if socket.joined:
                socket.say_goodbye(limit_s)

    def close(self) -> None:
        """Close every member's sockets and remove their files, whatever closing one raised."""
        if self._closed:
            return
        self._closed = True
        failures: list[BaseException] = []
        for socket in self._sockets:
            try:
                socket.close()
            except BaseException as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _each(self, call: Callable[[SenderSocket], Awaitable[T]]) -> None:
        """`call` on every member at once; the first failure cancels the rest and is raised
        as itself (never wrapped in a group), its member kept in `failed`."""
        if len(self._sockets) == 1:
            await self._one(call, self._sockets[0])
            return
        first: list[BaseException] = []

        async def run(socket: SenderSocket) -> None:
            try:
                await self._one(call, socket)
            except Exception as exc:
                if not first:
                    first.append(exc)
                group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            for socket in self._sockets:
                group.start_soon(run, socket)
        if first:
            raise first[0]

    async def _one(self, call: Callable[[SenderSocket], Awaitable[T]], socket: SenderSocket) -> T:
        try:
            return await call(socket)
        except Exception:
            if self.failed is None:
                self.failed = socket.member
            raise
