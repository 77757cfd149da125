"""The real weight channel between a trainer's end (a `WeightSender` on a thread of its own, as the
trainer worker's event loop is) and a rollout engine's inlet, in one short private directory.

A failed transfer ends its session on both sides (the design's rule 7): the sender is closed and
the next transfer opens a new one, as a restarted trainer worker would; the rollout's inlet is
kept, and must take the new session itself.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio

from tests.conftest import socket_files, staging_segments
from timeshare.engines.digest import WeightsDigest
from timeshare.engines.outlet import digested
from timeshare.protocols.weights import TransferConfig, TransferReport, WeightSender
from timeshare.protocols.weights.layout import Weight

# Small buckets: a version is several buckets, so a layer straddles two of them. Deadlines long
# enough for a loaded machine (vLLM's worker loads on the same two cores); a receiver that never
# comes costs the handshake's.
TRANSFER = TransferConfig(
    bucket_mb=0.05,
    begin_timeout_s=60.0,
    ack_timeout_s=60.0,
    handshake_timeout_s=20.0,
    linger_s=0.2,  # an idle receiver does not answer the goodbye of a closing sender
)
SEND_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Outcome:
    """Both ends of one transfer: each side's report, or what it raised."""

    sent: TransferReport | BaseException
    received: TransferReport | BaseException
    digest: str  # of what the sender put into staging (the trainer worker's SYNC digest)

    def reports(self) -> tuple[TransferReport, TransferReport]:
        """(sent, received); raises what either side raised, the receiver's first."""
        for side in (self.received, self.sent):
            if isinstance(side, BaseException):
                raise side
        assert isinstance(self.sent, TransferReport) and isinstance(self.received, TransferReport)
        return self.sent, self.received


class Channel:
    """A trainer's end of the weight channel and the runtime directory of its endpoint."""

    def __init__(self, prefix: str, receivers: int = 1) -> None:
        self.receivers = receivers  # the rollout engine's workers that each load a version
        self.runtime_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.runtime_dir.chmod(0o700)
        self.endpoint = f"ipc://{self.runtime_dir}/w.sock"
        self._trainer = ThreadPoolExecutor(1, thread_name_prefix="contract-trainer")
        self.sender: WeightSender | None = None

    def transfer(
        self,
        weights: Iterable[tuple[str, Weight]],
        version: int,
        receive: Callable[[], TransferReport],
    ) -> Outcome:
        """Send `weights` as `version` while `receive()` (the rollout's side) runs here."""
        if self.sender is None:
            make = partial(WeightSender, self.endpoint, TRANSFER, receivers=self.receivers)
            self.sender = self._trainer.submit(make).result()
        digest = WeightsDigest()
        send = partial(self.sender.send, digested(weights, digest), version=version)
        sending: Future[TransferReport] = self._trainer.submit(anyio.run, send)
        received: TransferReport | BaseException
        sent: TransferReport | BaseException
        try:
            received = receive()
        except Exception as exc:
            received = exc
        try:
            sent = sending.result(timeout=SEND_TIMEOUT_S)
        except Exception as exc:
            sent = exc
        if isinstance(sent, BaseException) or isinstance(received, BaseException):
            self.close_sender()  # the session is over on both sides
        return Outcome(sent, received, digest.hexdigest())

    def live_sockets(self) -> set[Path]:
        """The socket files the open session may keep: each receiver's endpoint and its own
        socket."""
        if self.sender is None:
            return set()
        endpoints = [self.sender.endpoint.member(k) for k in range(self.receivers)]
        session = self.sender.session
        paths = [p for e in endpoints for p in (e.path, e.session_socket(session).path)]
        return {path for path in paths if path is not None}

    def check_clean(self) -> None:
        """No staging segment of this directory in /dev/shm (staging is unlinked once both
        sides mapped it), and no socket file but the open session's."""
        assert staging_segments(self.runtime_dir) == set()
        assert set(socket_files(self.runtime_dir)) <= self.live_sockets()

    def close_sender(self) -> None:
        if self.sender is not None:
            sender, self.sender = self.sender, None
            self._trainer.submit(sender.close).result(timeout=30)

    def close(self) -> None:
        """Close the session, then check that it left nothing: no staging, no socket file."""
        try:
            self.close_sender()
            self._trainer.shutdown()
            assert staging_segments(self.runtime_dir) == set()
            assert socket_files(self.runtime_dir) == []
        finally:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
