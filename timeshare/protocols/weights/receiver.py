"""The rollout engine's side of the weight channel: connects REP, maps staging, loads buckets.

`receive` blocks (it runs inside an engine worker); `receive_async` runs it in a worker thread and
stops it within a poll slice when cancelled. Every request that reached the receiver gets a reply,
on every path: an ACK, or a Failure frame naming the exception, after which the receiver re-raises
its own exception. A bucket is ACKed only after `on_bucket` returned, the device was fenced and no
view of the staging buffer is left. Any failure ends the session on this side.

How the receiver talks to the sender (the REP socket, the checks on each request, the ACK or
Failure that answers it) is in receiver_socket.py; this module says what each request means.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from functools import partial
from typing import TypeAlias

import anyio
import anyio.lowlevel
import torch

from timeshare.errors import ProtocolError, SessionClosed, TransferError
from timeshare.protocols.weights import frames
from timeshare.protocols.weights.config import TransferConfig, TransferReport, check_number
from timeshare.protocols.weights.layout import Assembler, crc32, fence, payload_extent
from timeshare.protocols.weights.receiver_socket import ReceiverSocket
from timeshare.protocols.weights.staging import Staging
from timeshare.protocols.weights.transport import attach_staging
from timeshare.runtime import Endpoint
from timeshare.timing import Spans
from timeshare.units import MAX_DEADLINE_S

OnBucket: TypeAlias = Callable[[list[tuple[str, torch.Tensor]]], None]
Finalize: TypeAlias = Callable[[], None]
# How often a blocked receive looks at its cancel flag.
POLL_SLICE_S = 0.05


class _Cancelled(Exception):
    """Raised inside the receiving thread when `receive_async` was cancelled.

    A control-flow sentinel, not an error anyone reports: `_next_request` raises it and
    `_receive_or_none` always catches it, so it never leaves this module (which is why it is
    private here and not among the errors of errors.py, which callers catch). No work given to
    `ReceiverSocket.reply_to` waits for a request, so it is never reported to the sender either.
    """


class WeightReceiver:
    """Receives transfers from one `WeightSender`, delivering tensors to `on_bucket`.

    A sender may send each transfer to several receivers at once (an engine's tensor-parallel
    workers): this one is `member` of `members` and joins only an invitation for exactly that.
    """

    def __init__(
        self,
        endpoint: str,
        config: TransferConfig | None = None,
        device: str = "cpu",
        *,
        member: int = 0,
        members: int = 1,
    ) -> None:
        if not 0 <= member < members:
            raise TransferError(f"weight receiver: member {member} of {members} does not exist")
        self.member = member
        self.members = members
        self.endpoint = Endpoint.parse(endpoint).member(member)
        self.endpoint.check_connectable()
        self.config = config or TransferConfig()
        self.device = torch.device(device)
        self._staging: Staging | None = None
        self._closed_because: str | None = None
        self._cancel = threading.Event()
        self._spans = Spans()  # the current transfer's: loading each bucket, finalizing
        self._socket = ReceiverSocket(
            self.endpoint, linger_s=self.config.linger_s, member=member, members=members
        )

    def receive(
        self,
        on_bucket: OnBucket,
        finalize: Finalize | None = None,
        expected_names: Collection[str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> TransferReport:
        """Receive one whole transfer; block until it is FINALIZED.

        `on_bucket` gets each bucket's (name, tensor) pairs. Tensors of whole weights are views of
        staging, valid only during the call: copy what you keep (keeping a view is an error).
        `finalize` runs once after the last bucket (post-load processing). `expected_names`, when
        given, must be exactly the set of names sent. `timeout_s` bounds the wait for the transfer
        to begin (default: the config's begin_timeout_s).
        """
        report = self._receive_or_none(on_bucket, finalize, expected_names, timeout_s)
        if report is None:  # receive_async's cancel flag was set while this call ran
            raise self._cancelled_error()
        return report

    async def receive_async(
        self,
        on_bucket: OnBucket,
        finalize: Finalize | None = None,
        expected_names: Collection[str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> TransferReport:
        """`receive` in a worker thread; cancelling it ends the session within a poll slice.

        Raises what `receive` raises, as itself (never wrapped in an exception group).
        """
        # None: the thread saw the flag set below; the caller's cancellation is raised on return.
        run = partial(self._receive_or_none, on_bucket, finalize, expected_names, timeout_s)

        async def flag_cancellation() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                self._cancel.set()

        failure: BaseException | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(flag_cancellation)
            # Not abandoned: the thread owns the socket until it has seen the flag and shut down.
            # Its failure is raised after the group: raised inside, the group would wrap it.
            try:
                report = await anyio.to_thread.run_sync(run)
            except BaseException as exc:  # the thread's own: run_sync is not cancellable
                failure = exc
            group.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if report is None:
            await anyio.lowlevel.checkpoint()  # raises the caller's cancellation
            raise self._cancelled_error()
        return report

    @property
    def closed(self) -> bool:
        """Closed, or broken by a failed transfer (a new receiver is needed)."""
        return self._closed_because is not None

    def close(self) -> None:
        """Unmap staging and close the socket (a last reply still goes out, within linger_s)."""
        if self._closed_because is None:
            self._shutdown("closed")

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- one transfer -----------------------------------------------------------------------

    def _receive_or_none(
        self,
        on_bucket: OnBucket,
        finalize: Finalize | None,
        expected_names: Collection[str] | None,
        timeout_s: float | None,
    ) -> TransferReport | None:
        """`receive`, or None when the cancel flag stopped it; either way a failure closes."""
        self._check_usable()
        if timeout_s is not None:  # a caller's bound must be a real deadline
            check_number("timeout_s", timeout_s, above=0, most=MAX_DEADLINE_S)
        self._cancel.clear()
        expected = None if expected_names is None else frozenset(expected_names)
        try:
            return self._receive(on_bucket, finalize, expected, timeout_s)
        except _Cancelled as exc:  # the only place it is caught: see _Cancelled
            self._shutdown(str(exc))
            return None
        except BaseException as exc:
            self._shutdown(f"{type(exc).__name__}: {exc}")
            raise

    def _receive(
        self,
        on_bucket: OnBucket,
        finalize: Finalize | None,
        expected: frozenset[str] | None,
        timeout_s: float | None,
    ) -> TransferReport:
        begin_s = self.config.begin_timeout_s if timeout_s is None else timeout_s
        waiting_since = time.monotonic()
        frame = self._next_request("begin", begin_s)
        started = time.perf_counter()
        while isinstance(frame, frames.Invite):
            if self._socket.join(frame):
                frame = self._next_request("handshake", self.config.handshake_timeout_s)
            else:  # a stale invitation: the wait for the transfer to begin goes on
                frame = self._next_request("begin", begin_s, since=waiting_since)
        if isinstance(frame, frames.Offer):
            if self._staging is not None:
                self._socket.fail(frame, ProtocolError("second handshake in one session"))
            self._socket.reply_to(frame, partial(self._map_staging, frame), step="mapped")
            frame = self._next_request("bucket", self.config.ack_timeout_s, bucket=0)
            started = time.perf_counter()
        if self._staging is None:
            self._socket.fail(frame, ProtocolError(f"{type(frame).__name__} before the handshake"))
        version = getattr(frame, "version", 0)
        assembler = Assembler(expected)
        self._spans.take()
        buckets = checksummed = 0
        released = False
        while isinstance(frame, frames.Bucket) and not released:
            self._socket.check_bucket(frame, version, buckets, len(self._staging.buffers))
            load = partial(self._load, frame, assembler, on_bucket)
            released = frame.last is not None
            self._socket.reply_to(frame, load, step="released" if released else "bucket")
            buckets += 1
            checksummed += frame.checksum is not None
            if released:
                frame = self._next_request("finalize", self.config.ack_timeout_s)
            else:
                frame = self._next_request("bucket", self.config.ack_timeout_s, bucket=buckets)
        if not released:
            frame = self._release(frame, version, assembler)
        if not isinstance(frame, frames.Finalize):
            self._socket.fail(
                frame, ProtocolError(f"expected finalize, got {type(frame).__name__}")
            )
        self._socket.check_version(frame, version)
        self._socket.reply_to(frame, lambda: self._finalize(finalize), step="finalized")
        seconds = time.perf_counter() - started
        delivered = len(assembler.delivered)
        return TransferReport(
            version,
            assembler.bytes,
            delivered,
            buckets,
            seconds,
            checksummed,
            spans=self._spans.take(),
        )

    def _release(self, frame: frames.Request, version: int, assembler: Assembler) -> frames.Request:
        """The Release request of a transfer whose last bucket did not carry the totals."""
        if not isinstance(frame, frames.Release):
            self._socket.fail(
                frame, ProtocolError(f"expected a bucket or release, got {type(frame).__name__}")
            )
        self._socket.check_version(frame, version)
        totals = frames.Totals(frame.tensors, frame.nbytes)
        self._socket.reply_to(frame, partial(assembler.check_complete, totals), step="released")
        return self._next_request("finalize", self.config.ack_timeout_s)

    def _map_staging(self, offer: frames.Offer) -> None:
        if offer.staging.buffer_bytes <= 0 or offer.staging.count == 0:
            raise ProtocolError(f"offer describes no staging: {offer.staging}")
        self._staging = attach_staging(offer.staging)

    def _load(self, bucket: frames.Bucket, assembler: Assembler, on_bucket: OnBucket) -> None:
        with self._spans.span(f"load {bucket.index}"):
            self._load_into(bucket, assembler, on_bucket)

    def _load_into(self, bucket: frames.Bucket, assembler: Assembler, on_bucket: OnBucket) -> None:
        assert self._staging is not None
        base, storage = self._staging.view(bucket.buffer)
        tensors: list[tuple[str, torch.Tensor]] = []
        try:
            if bucket.checksum is not None:
                _check_checksum(bucket, base)
            tensors = assembler.unpack(bucket.pieces, base)
            on_bucket(tensors)
            fence([self.device])
        finally:
            tensors.clear()
            del base
        if bucket.last is not None:
            assembler.check_complete(bucket.last)
        kept = self._staging.kept_views(storage)
        if kept:
            raise TransferError(
                f"on_bucket kept tensors that view staging buffer {bucket.buffer} after bucket "
                f"{bucket.index} ({kept} references); copy what you keep (the buffer is reused)"
            )

    def _finalize(self, finalize: Finalize | None) -> None:
        started = time.perf_counter()
        with self._spans.span("finalize"):
            if finalize is not None:
                finalize()
            fence([self.device])
        elapsed = time.perf_counter() - started
        if elapsed > self.config.finalize_timeout_s:
            raise TransferError(
                f"finalize took {elapsed:.1f} s, more than finalize_timeout_s "
                f"({self.config.finalize_timeout_s:g} s)"
            )

    # -- requests ---------------------------------------------------------------------------

    def _next_request(
        self, phase: str, timeout: float, bucket: int | None = None, *, since: float | None = None
    ) -> frames.Request:
        """Wait for the sender's next frame, until `timeout` after `since` (default: now); a
        dead or silent sender is an AckTimeout."""
        deadline = (time.monotonic() if since is None else since) + timeout
        while True:
            if self._cancel.is_set():
                raise _Cancelled("receive_async was cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._socket.silence(phase, timeout, bucket)
            if self._socket.poll(min(remaining, POLL_SLICE_S)):
                return self._socket.read_request()

    # -- ending -----------------------------------------------------------------------------

    def _shutdown(self, reason: str) -> None:
        self._closed_because = reason
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self._socket.close()

    def _check_usable(self) -> None:
        if self._closed_because is not None:
            raise SessionClosed(
                f"weight receiver {self.endpoint.url} is closed ({self._closed_because}); "
                "open a new sender/receiver pair"
            )

    def _cancelled_error(self) -> SessionClosed:
        return SessionClosed(f"weight receiver {self.endpoint.url}: receive was cancelled")


def _check_checksum(bucket: frames.Bucket, base: torch.Tensor) -> None:
    actual = crc32(base[: payload_extent(bucket.pieces)])
    if actual != bucket.checksum:
        raise TransferError(f"bucket {bucket.index} checksum {actual:#x} != {bucket.checksum:#x}")
