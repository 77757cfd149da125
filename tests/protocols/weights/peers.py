"""Starting weight-channel peers in real subprocesses and reading their JSON events."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from timeshare.protocols.weights import weight_endpoint

ROOT = Path(__file__).resolve().parents[3]


def endpoint(runtime_dir: Path) -> str:
    """The endpoint the channel's tests use: rank 0's weight channel in `runtime_dir`."""
    return weight_endpoint(runtime_dir, 0)


class Peer:
    """One `tests.protocols.weights.peer` process; killed on exit from its `with` block."""

    def __init__(self, **args: Any) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.protocols.weights.peer", json.dumps(args)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        self._stdout = self.proc.stdout
        # Lines read from the pipe and not yet taken: unbuffered reads of our own, so that a
        # line already read is never hidden from select() in a file object's buffer.
        self._pending = b""

    def has_event(self) -> bool:
        """Whether an event is waiting (never blocks)."""
        return b"\n" in self._pending or self._read_some(0.0)

    def next_event(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            came = self._read_some(max(0.0, deadline - time.monotonic()))
            if not came and time.monotonic() >= deadline:
                raise TimeoutError(f"peer sent no event in {timeout} s; stderr:\n{self.stderr()}")
        line, self._pending = self._pending.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event

    def _read_some(self, timeout: float) -> bool:
        """Read what the pipe has within `timeout`; whether anything came."""
        ready, _, _ = select.select([self._stdout], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(self._stdout.fileno(), 65536)
        if not chunk:
            raise EOFError(f"peer exited (rc={self.proc.poll()}); stderr:\n{self.stderr()}")
        self._pending += chunk
        return True

    def wait_ready(self) -> int:
        event = self.next_event(timeout=60.0)
        assert event["event"] == "ready", event
        pid: int = event["pid"]
        return pid

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> Peer:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
        self._stdout.close()
        self._stderr.close()


def wait_until(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def first_to_speak(peers: list[Peer], timeout: float = 60.0) -> Peer:
    """The first of `peers` with an event waiting (left for its `next_event`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for peer in peers:
            if peer.has_event():
                return peer
        time.sleep(0.02)
    raise TimeoutError(f"none of {len(peers)} peers sent an event in {timeout} s")
