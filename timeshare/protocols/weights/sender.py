"""The trainer's side of the weight channel: binds REQ, owns staging, streams buckets.

One `WeightSender` is one session: the first `send` sets up staging (handshake), every later
`send` reuses it. With pipeline depth 2 the next bucket is packed while the receiver consumes the
previous one. Any failure inside a transfer ends the session on this side (staging freed, socket
closed, socket file removed): a bucket is never re-sent, a new pair is needed.

What `send` accepts and checks up front is in sender_inputs.py; how the sender talks to the
receiver (the REQ socket, its deadlines, the checks on each ACK) in sender_socket.py.

A `LentTensor` (lent.py) writes itself into staging and may block on a collective doing so: a
bucket holding one is always packed in a worker thread, and one materialized (too large for a
bucket) is materialized in a worker thread, in both cases in the order the items came in.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from functools import partial
from typing import NamedTuple

import anyio
import structlog
import torch

from timeshare.errors import SessionClosed, TransferError
from timeshare.protocols.weights import frames
from timeshare.protocols.weights.config import TransferConfig, TransferReport
from timeshare.protocols.weights.frames import PROTOCOL_VERSION
from timeshare.protocols.weights.layout import (
    BucketPlanner,
    PlannedBucket,
    Weight,
    crc32,
    fence,
    pack,
    written_devices,
)
from timeshare.protocols.weights.lent import LentTensor
from timeshare.protocols.weights.members import SessionMembers
from timeshare.protocols.weights.segments import staging_tag
from timeshare.protocols.weights.sender_inputs import (
    NamedTensors,
    check_version,
    checked_up_front,
    pairs,
    peeked,
)
from timeshare.protocols.weights.staging import Staging
from timeshare.protocols.weights.transport import create_staging
from timeshare.runtime import Endpoint
from timeshare.timing import Spans

log = structlog.get_logger(__name__)

# Buckets smaller than this are packed on the event loop: a thread hop would cost more.
INLINE_PACK_BYTES = 1 << 20
# An abort notice to the receiver is best effort and never waits longer than this.
ABORT_NOTICE_S = 5.0


class InFlight(NamedTuple):
    """A bucket header sent and not yet ACKed."""

    seq: int
    buffer: int
    bucket: int
    sent: float  # time.perf_counter() as its header went out


async def planned(
    planner: BucketPlanner, name: str, weight: Weight
) -> AsyncIterator[PlannedBucket]:
    """The buckets `planner.add` completes with `weight`, each yielded once planned.

    A LentTensor too large for a bucket is materialized while planning, which may wait on a
    collective: then each step of the planning runs in a worker thread. The planner yields the
    bucket before it (whose lent pieces the caller writes) before it materializes, so the order
    of the collectives stays the order of the items.
    """
    buckets = planner.add(name, weight)
    if not isinstance(weight, LentTensor) or planner.lent_fits(weight):
        for bucket in buckets:
            yield bucket
        return
    step = partial(next, buckets, None)
    while (bucket := await anyio.to_thread.run_sync(step)) is not None:
        yield bucket


class WeightSender:
    """Sends named tensors to `receivers` `WeightReceiver`s at once (an engine's tensor-parallel
    workers: members.py), through one staging; async, never blocks the event loop."""

    def __init__(
        self, endpoint: str, config: TransferConfig | None = None, *, receivers: int = 1
    ) -> None:
        self.config = config or TransferConfig()
        self._session = secrets.randbits(63)
        self._staging: Staging | None = None
        self._checksummed = 0  # buckets of the current transfer that carry a crc32
        self._ack_seconds: list[float] = []  # the current transfer's, bucket by bucket
        self._spans = Spans()  # the current transfer's: packing, waiting for ACKs, finalizing
        self._busy = False
        self._closed_because: str | None = None
        self._socket = SessionMembers(
            Endpoint.parse(endpoint),
            session=self._session,
            ack_timeout_s=self.config.ack_timeout_s,
            members=receivers,
        )

    async def send(self, weights: NamedTensors, *, version: int) -> TransferReport:
        """Send every (name, tensor) of `weights` as weight version `version`; a tensor may be
        a LentTensor, which writes itself into staging (lent.py).

        Returns after the receiver has finished post-load processing (FINALIZED). Sized inputs
        (a dict, list or tuple) are validated whole before anything is sent.
        """
        self._check_usable()
        check_version(version)
        weights = checked_up_front(weights)
        self._busy = True
        try:
            return await self._transfer(weights, version)
        except BaseException as exc:
            await self._abort_after(exc, version)
            raise
        finally:
            self._busy = False

    def close(self) -> None:
        """End the session: tell an idle receiver, free staging, remove the socket file.

        Blocks at most `linger_s` (delivering the goodbye). Refused while a transfer runs in
        another task: staging must not be freed under it (cancel that task first).
        """
        if self._closed_because is not None:
            return
        if self._busy:
            raise TransferError(
                f"weight sender {self.endpoint.url}: close() while a transfer is in progress"
            )
        if self._staging is not None:  # a receiver joined and mapped staging
            self._socket.say_goodbye(self.config.linger_s)
        self._shutdown("closed")

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def endpoint(self) -> Endpoint:
        """Where receivers connect, as bound (for `tcp://host:0`, the port it got)."""
        return self._socket.endpoint

    @property
    def session(self) -> int:
        return self._session

    @property
    def receivers(self) -> int:
        """How many receivers each transfer goes to (every one loads every bucket)."""
        return self._socket.members

    @property
    def session_endpoint(self) -> Endpoint:
        """The socket bound for this session alone; only the receiver that joined knows it."""
        return self._socket.session_endpoint

    @property
    def staging_buffers(self) -> int:
        """How many staging buffers the session holds (0 before the first transfer)."""
        return len(self._staging.buffers) if self._staging is not None else 0

    # -- one transfer -----------------------------------------------------------------------

    async def _transfer(self, weights: NamedTensors, version: int) -> TransferReport:
        self._spans.take()  # (what an earlier, failed transfer left)
        started = time.perf_counter()  # producing the weights is part of the transfer...
        device, items = await peeked(pairs(weights))
        if self._staging is None:  # staged where the weights are (transport.py)
            with self._spans.span("handshake"):
                await self._handshake(device)
            started = time.perf_counter()  # ...a first one's handshake is not
        staging = self._staging
        assert staging is not None
        planner = BucketPlanner(staging.buffer_bytes)
        free = deque(range(len(staging.buffers)))
        in_flight: InFlight | None = None  # the header awaiting its ACK
        index = 0
        self._checksummed = 0
        self._ack_seconds = []
        async for name, weight in items:
            async for bucket in planned(planner, name, weight):
                in_flight = await self._send_bucket(bucket, index, version, free, in_flight)
                index += 1
            del weight  # not held while the next one is produced: the planner keeps its own
        # The iteration is over: a bucket still to send is the last, and says the totals, so that
        # its ACK is RELEASED and no Release round trip is needed.
        totals = frames.Totals(planner.tensors, planner.bytes)
        last = list(planner.finish())
        for bucket in last:
            in_flight = await self._send_bucket(
                bucket, index, version, free, in_flight, last=totals
            )
            index += 1
        if last:
            assert in_flight is not None
            limit_s = self.config.ack_timeout_s
            with self._spans.span(f"ACK {index - 1}"):
                await self._socket.await_ack(
                    in_flight.seq, version, "released", limit_s, bucket=index - 1
                )
            self._ack_seconds.append(time.perf_counter() - in_flight.sent)
        else:
            if in_flight is not None:
                await self._await_bucket_ack(in_flight, version)
            seq = self._socket.next_seq()
            release = frames.Release(
                PROTOCOL_VERSION, self._session, version, seq, totals.tensors, totals.nbytes
            )
            with self._spans.span("release"):
                await self._socket.request(release, "released", self.config.ack_timeout_s)
        seq = self._socket.next_seq()
        finalize = frames.Finalize(PROTOCOL_VERSION, self._session, version, seq)
        with self._spans.span("finalize"):
            await self._socket.request(finalize, "finalized", self.config.finalize_timeout_s)
        seconds = time.perf_counter() - started
        report = TransferReport(
            version,
            planner.bytes,
            planner.tensors,
            index,
            seconds,
            self._checksummed,
            tuple(self._ack_seconds),
            self._spans.take(),
        )
        log.debug(
            "sync.transfer.finalized",
            endpoint=self.endpoint.url,
            version=version,
            bytes=report.bytes,
            buckets=index,
            gbps=round(report.gbps, 3),
        )
        return report

    async def _send_bucket(
        self,
        bucket: PlannedBucket,
        index: int,
        version: int,
        free: deque[int],
        in_flight: InFlight | None,
        *,
        last: frames.Totals | None = None,
    ) -> InFlight:
        """Pack `bucket` into a free buffer, then send its header once the previous one is ACKed."""
        assert self._staging is not None
        if not free:
            assert in_flight is not None
            free.append(await self._await_bucket_ack(in_flight, version))
            in_flight = None
        buffer = free.popleft()
        with self._spans.span(f"pack {index}"):
            checksum = await self._pack(bucket, buffer)
        self._checksummed += checksum is not None
        pieces = [p.piece for p in bucket.pieces]
        # Packed: the sources may go now (a trainer gathering its weights one at a time frees
        # each as soon as the sender no longer needs it, not one bucket later).
        bucket.pieces.clear()
        if in_flight is not None:
            free.append(await self._await_bucket_ack(in_flight, version))
        seq = self._socket.next_seq()
        header = frames.Bucket(
            PROTOCOL_VERSION, self._session, version, seq, index, buffer, pieces, checksum, last
        )
        await self._socket.send(header, "bucket", seq, bucket=index)
        return InFlight(seq, buffer, index, time.perf_counter())

    async def _pack(self, bucket: PlannedBucket, index: int) -> int | None:
        staging = self._staging
        assert staging is not None
        buffer = staging.buffers[index]

        def work() -> int | None:
            staging.ready(index)  # a cold session's buffer may still be faulting in
            pack(bucket, buffer)
            fence(written_devices(bucket, buffer))
            if self.config.checksum:  # after every write, a LentTensor's padding included
                return crc32(buffer[: bucket.extent])
            return None

        # A LentTensor's write may wait on a collective, and a buffer may still be faulting in:
        # never on the event loop, however small.
        if bucket.payload <= INLINE_PACK_BYTES and not bucket.lends and staging.is_ready(index):
            return work()
        # Not abandoned on cancel: staging must not be freed while a thread still writes it.
        return await anyio.to_thread.run_sync(work)

    async def _handshake(self, device: torch.device) -> Staging:
        # Staging's pages are faulted in after the handshake, in the background (hundreds of ms
        # per 512 MiB buffer): each bucket's pack waits only for its own buffer. Creating it
        # (segments, mappings) is file system calls: in a worker thread, off the event loop.
        staging = await anyio.to_thread.run_sync(
            partial(
                create_staging,
                self.config.transport,
                count=self.config.pipeline_depth,
                buffer_bytes=self.config.bucket_bytes,
                tag=staging_tag(self.endpoint.runtime_dir),
                session=self._session,
                device=device,
            )
        )
        self._staging = staging
        try:
            # Only the receiver that joins learns the session's socket. Each wait of the
            # handshake has the whole handshake deadline (config.py says which they are).
            # Several receivers all map the same staging before its names go.
            await self._socket.invite(self.config.handshake_timeout_s)
            offer = frames.Offer(PROTOCOL_VERSION, self._session, staging.describe())
            await self._socket.request(offer, "mapped", self.config.handshake_timeout_s, seq=0)
            staging.start_fault_in()
        finally:
            # Named only until the receiver has mapped it (or failed to): nothing to sweep later.
            staging.unlink_names()
        return staging

    # -- ACKs -------------------------------------------------------------------------------

    async def _await_bucket_ack(self, in_flight: InFlight, version: int) -> int:
        """Wait for a bucket's ACK; return its buffer, free again."""
        limit_s = self.config.ack_timeout_s
        with self._spans.span(f"ACK {in_flight.bucket}"):
            await self._socket.await_ack(
                in_flight.seq, version, "bucket", limit_s, bucket=in_flight.bucket
            )
        self._ack_seconds.append(time.perf_counter() - in_flight.sent)
        return in_flight.buffer

    # -- ending -----------------------------------------------------------------------------

    async def _abort_after(self, exc: BaseException, version: int) -> None:
        """After a failed transfer: tell the receiver when it can still listen, then shut down.

        The notice is best effort and bounded; nothing it raises replaces `exc`.
        """
        reason = f"{type(exc).__name__}: {exc}"
        # Before a receiver joined there is nobody to tell (and a notice would wait in vain);
        # the receiver that failed (its error, its silence) is not told either: members.py.
        if self._socket.joined:  # (joined: staging exists, it is made before the invitation)
            with anyio.CancelScope(shield=True), anyio.move_on_after(ABORT_NOTICE_S):
                await self._socket.send_abort_notice(version, reason)
        self._shutdown(reason)

    def _shutdown(self, reason: str) -> None:
        """Free everything, the sockets and their files even when freeing staging raised;
        nothing waits (a goodbye was answered, or given up on, before)."""
        self._closed_because = reason
        staging, self._staging = self._staging, None
        try:
            if staging is not None:
                staging.unlink_names()
                staging.close()
        finally:
            self._socket.close()

    def _check_usable(self) -> None:
        if self._closed_because is not None:
            raise SessionClosed(
                f"weight sender {self.endpoint.url} is closed ({self._closed_because}); "
                "open a new sender/receiver pair"
            )
        if self._busy:
            raise TransferError(f"weight sender {self.endpoint.url} is already sending")
