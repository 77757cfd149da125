"""The driver's end of the zygote (zygote.py), and the zygote's wire format.

Start it, ask it for workers, hear of each exit. Asking does not wait: the zygote first loads
the worker's code (seconds), then answers each request with the worker's pid; `replies` hands
every pid and every exit to the driver as they come, so that waiting for workers stays the
lanes' business (`wait_ready`, under `[deadlines].ready_s`). Both ways, one JSON line per
message, each a typed msgspec Struct: never pickle, never a dict read by string keys.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec

from timeshare.engines.worker import WorkerSpec
from timeshare.errors import WorkersNotReady

PROGRAM = "timeshare.cycle.zygote"
CLOSE_S = 10.0  # for the zygote to kill and reap what is left, and exit


class ForkRequest(msgspec.Struct, frozen=True):
    """Driver to zygote: fork a worker that runs `spec`."""

    request_id: int
    spec: WorkerSpec


class _Reply(msgspec.Struct, frozen=True, tag_field="kind"):
    """Zygote to driver."""


class Forked(_Reply, frozen=True, tag="forked"):
    """The worker of request `request_id` runs, as process `pid`."""

    request_id: int
    pid: int


class Exited(_Reply, frozen=True, tag="exited"):
    """Worker process `pid` exited (`returncode`: negative for the signal that ended it)."""

    pid: int
    returncode: int


class Refused(_Reply, frozen=True, tag="refused"):
    """The zygote could not take a request (a bug of the driver's: it is logged)."""

    error: str


Reply = Forked | Exited | Refused
_replies = msgspec.json.Decoder(Reply)


class WorkerFactory:
    """The driver's handle on its zygote: ask for workers, hear of their exits, close."""

    def __init__(self, process: subprocess.Popen[bytes], replies_fd: int) -> None:
        self.process = process
        self.replies_fd = replies_fd
        self._lines = b""

    @classmethod
    def start(cls, runtime: Path, env: dict[str, str]) -> WorkerFactory:
        """Start the zygote (blocking: call it in a worker thread)."""
        replies_r, replies_w = os.pipe()
        argv = [sys.executable, "-m", PROGRAM, str(runtime), "--replies", str(replies_w)]
        # BLAS would start a thread at import; forking from one thread only is the safe way.
        env = {**env, "OPENBLAS_NUM_THREADS": "1"}
        try:
            process = subprocess.Popen(  # its own session: a terminal's ^C is for the driver
                argv, stdin=subprocess.PIPE, pass_fds=(replies_w,), env=env, start_new_session=True
            )
        finally:
            os.close(replies_w)
        os.set_blocking(replies_r, False)
        return cls(process, replies_r)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def fork(self, request_id: int, spec: WorkerSpec) -> None:
        """Ask for a worker running `spec`; its pid comes as `replies` go."""
        line = msgspec.json.encode(ForkRequest(request_id, spec)) + b"\n"
        try:
            await anyio.to_thread.run_sync(self._send, line)
        except OSError as exc:  # the zygote is gone (BrokenPipeError)
            why = f"the zygote took no request ({self.process.poll()}): {exc}"
            raise WorkersNotReady(why, rank=spec.rank, role=spec.role, command=None) from exc

    def wait_exited(self, timeout_s: float = 5.0) -> int | None:
        """The zygote's exit status, once its replies ended (blocking: a worker thread)."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    async def replies(self) -> AsyncIterator[Reply]:
        """The zygote's replies, as they come, until it is gone."""
        while True:
            await anyio.wait_readable(self.replies_fd)
            data = os.read(self.replies_fd, 1 << 16)
            if not data:
                return
            *lines, self._lines = (self._lines + data).split(b"\n")
            for line in lines:
                yield _replies.decode(line)

    def close(self) -> None:
        """The zygote kills what is left of its workers, reaps them, exits (blocking)."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=CLOSE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10.0)
        os.close(self.replies_fd)

    def _send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)
        self.process.stdin.flush()
