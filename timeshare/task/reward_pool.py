"""A small pool of reward processes (reward_child.py), owned by the rollout worker.

Why processes: a reward function that hangs must not freeze the worker (its process is killed at
the call's deadline), one that crashes its interpreter must cost only its sample (a fresh
process takes its place), and math-verify's timeouts need the main thread (signal.alarm).

Synchronous code: `score` multiplexes the children's pipes with `selectors`, dispatching each
call to an idle child, in order; every wait has a deadline (a call's `timeout_s`, a start's
`start_timeout_s`, a close's grace), and `progress` is called at least once a second so that a
long scoring pass is never taken for a stall. The pool reports every outcome as it is; what a
failure does (`on_error`, `max_skipped_fraction`) is the caller's rule (scoring.py).

One caller at a time: `score` refuses to run twice at once.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import msgspec

from timeshare.errors import ConfigError, RewardFunctionError
from timeshare.task.reward_child import HEADER, MAX_FRAME_BYTES, ChildArgs, Hello, frame
from timeshare.task.reward_function import (
    RewardCall,
    RewardOutcome,
    RewardSpec,
)

# The longest a wait goes without looking at deadlines, deaths and progress.
TICK_S = 0.25
PROGRESS_EVERY_S = 0.5
# At close, idle children end at the end of their stdin within this; the rest are killed.
CLOSE_GRACE_S = 2.0
# A process sent SIGKILL (or whose pipe ended) is reaped within this.
REAP_S = 5.0
READ_BYTES = 1 << 16

ChildState = Literal["starting", "idle", "busy"]


def exit_said(returncode: int | None) -> str:
    """How a process ended, in words: "exit code 3", "killed by SIGKILL"."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class _Child:
    """One reward process, its pipes (non-blocking) and what it is doing."""

    def __init__(self, process: subprocess.Popen[bytes], start_deadline: float) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.stdin = process.stdin
        self.stdout = process.stdout
        os.set_blocking(self.stdin.fileno(), False)
        os.set_blocking(self.stdout.fileno(), False)
        self.state: ChildState = "starting"
        self.deadline = start_deadline
        self.index: int | None = None  # the call it serves
        self.dispatched = 0.0
        self.received = bytearray()
        self.pending = b""  # a call's frame, what is left to write of it
        self.ended = False  # its stdout reached end of file

    @property
    def pid(self) -> int:
        return self.process.pid

    def read(self) -> list[bytes]:
        """The whole frames its stdout holds now (sets `ended` at end of file)."""
        while True:
            try:
                chunk = os.read(self.stdout.fileno(), READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                self.ended = True
                break
            self.received += chunk
        frames = []
        while len(self.received) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.received)
            if size > MAX_FRAME_BYTES:
                raise msgspec.DecodeError(f"a frame of {size} bytes: the stream is broken")
            if len(self.received) < HEADER.size + size:
                break
            frames.append(bytes(self.received[HEADER.size : HEADER.size + size]))
            del self.received[: HEADER.size + size]
        return frames

    def write(self) -> None:
        """As much of the pending frame as its stdin takes now (BrokenPipeError if it died)."""
        while self.pending:
            try:
                written = os.write(self.stdin.fileno(), self.pending)
            except BlockingIOError:
                return
            self.pending = self.pending[written:]


class RewardPool:
    """`spec.processes` reward processes serving `score`; `close` (or the with block) ends them.

    `columns`: the dataset's columns, when known: the function's parameters are then checked
    against them at start (a required parameter nothing supplies is a ConfigError).
    """

    def __init__(
        self,
        spec: RewardSpec,
        *,
        base_dir: Path,
        start_timeout_s: float = 60.0,
        columns: Iterable[str] | None = None,
    ) -> None:
        self.spec = spec
        self.base_dir = base_dir
        self.start_timeout_s = start_timeout_s
        self.columns = None if columns is None else list(columns)
        self._children: list[_Child] = []
        self._selector = selectors.DefaultSelector()
        self._closed = False
        self._scoring = threading.Lock()
        self._outcomes: dict[int, RewardOutcome] = {}
        self._calls: Sequence[RewardCall] = ()
        self._hello = msgspec.msgpack.Decoder(Hello)
        self._outcome = msgspec.msgpack.Decoder(RewardOutcome)
        self._encoder = msgspec.msgpack.Encoder()
        try:
            for _ in range(spec.processes):
                self._start()
            while any(child.state == "starting" for child in self._children):
                self._pump(TICK_S)
        except BaseException:
            self.close()
            raise

    # -- the public side ---------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """The pids of its reward processes now (a replaced one is gone from here)."""
        return [child.pid for child in self._children]

    def score(
        self, calls: Sequence[RewardCall], progress: Callable[[], None] | None = None
    ) -> list[RewardOutcome]:
        """Each call's outcome, in the calls' order. A call past `spec.timeout_s`, or whose
        process died, has an outcome with its error (score None) and its process is replaced;
        the other calls go on. RewardFunctionError for a call that cannot be sent (nothing
        sent; the pool stays open), or if a replacement cannot start (ConfigError if its
        function no longer loads): the pool is closed then."""
        if self._closed:
            raise RewardFunctionError(f"the reward pool of {self.spec.where} is closed")
        if not self._scoring.acquire(blocking=False):
            raise RewardFunctionError(
                f"the reward pool of {self.spec.where} is already scoring: one caller at a time"
            )
        try:
            payloads = self._payloads(calls)
        except BaseException:
            self._scoring.release()
            raise
        try:
            return self._score(calls, payloads, progress)
        except BaseException:
            self.close()
            raise
        finally:
            self._scoring.release()
            self._calls = ()
            self._outcomes = {}

    def close(self) -> None:
        """End every reward process: idle ones at the end of their stdin (within a grace), the
        others killed; every one reaped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        children, self._children = self._children, []
        for child in children:
            with contextlib.suppress(OSError):
                child.stdin.close()
            if child.state != "idle":
                with contextlib.suppress(OSError):
                    child.process.kill()
        grace_ends = time.monotonic() + CLOSE_GRACE_S
        for child in children:
            self._reap(child, max(0.0, grace_ends - time.monotonic()))
        self._selector.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- scoring -----------------------------------------------------------------------------------

    def _payloads(self, calls: Sequence[RewardCall]) -> list[bytes]:
        """Each call as msgpack, before any is sent: a row value that has no msgpack form
        (a numpy array, an object) is refused by name, and the pool stays as it was."""
        payloads = []
        for call in calls:
            try:
                payloads.append(self._encoder.encode(call))
            except (TypeError, ValueError, OverflowError) as error:
                raise RewardFunctionError(
                    f"{self.spec.where}: sample {call.sample_id} (row {call.row_index}) cannot "
                    f"be sent to a reward process ({error}): a row's values must be JSON-like"
                ) from error
        return payloads

    def _score(
        self,
        calls: Sequence[RewardCall],
        payloads: list[bytes],
        progress: Callable[[], None] | None,
    ) -> list[RewardOutcome]:
        self._calls = calls
        self._outcomes = {}
        waiting = deque(range(len(calls)))
        last_progress = time.monotonic()
        self._pump(0.0)  # a process that died while idle is replaced before it is given work
        while len(self._outcomes) < len(calls):
            for child in list(self._children):  # a dispatch may replace a child
                if waiting and child.state == "idle" and child in self._children:
                    index = waiting.popleft()
                    if not self._dispatch(child, index, payloads[index]):
                        waiting.appendleft(index)
            self._pump(TICK_S)
            if progress is not None and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                progress()
                last_progress = time.monotonic()
        return [self._outcomes[index] for index in range(len(calls))]

    def _dispatch(self, child: _Child, index: int, payload: bytes) -> bool:
        """Give call `index` to idle `child`; False if the child was found dead before it took
        any of it (it is replaced, and the call is not its: it goes to another)."""
        started = time.monotonic()
        child.pending = frame(payload)
        died = False
        try:
            child.write()
        except BrokenPipeError:
            if len(child.pending) == HEADER.size + len(payload):
                self._on_death(child)  # it died idle: no outcome is anyone's
                return False
            died = True
        child.state, child.index, child.dispatched = "busy", index, started
        child.deadline = started + self.spec.timeout_s
        if died:
            self._on_death(child)
        elif child.pending:  # the rest when its stdin takes it
            self._selector.register(child.stdin, selectors.EVENT_WRITE, child)
        return True

    def _pump(self, timeout: float) -> None:
        """One wait on the children's pipes (at most `timeout`, less if a deadline comes
        sooner), then whatever it brought: frames, ends, deaths, deadlines passed."""
        now = time.monotonic()
        soonest = min((child.deadline for child in self._children), default=now + timeout)
        for key, events in self._selector.select(max(0.0, min(timeout, soonest - now))):
            child = key.data
            if child not in self._children:
                continue  # replaced by an earlier event of this wait
            if events & selectors.EVENT_WRITE:
                self._on_writable(child)
            elif events & selectors.EVENT_READ:
                self._on_readable(child)
        now = time.monotonic()
        for child in list(self._children):
            if child.process.poll() is not None and not child.ended:
                self._on_readable(child)  # what it wrote before it died, then its death
                if child not in self._children:
                    continue
            if child.process.poll() is not None:
                self._on_death(child)
            elif now >= child.deadline:
                self._on_deadline(child)

    def _on_writable(self, child: _Child) -> None:
        try:
            child.write()
        except BrokenPipeError:
            self._on_death(child)
            return
        if not child.pending:
            self._selector.unregister(child.stdin)

    def _on_readable(self, child: _Child) -> None:
        try:
            for payload in child.read():
                self._on_frame(child, payload)
                if child not in self._children:
                    return
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            self._on_broken(child, f"sent a frame that is not the protocol ({error})")
            return
        if child.ended:
            self._on_death(child)

    def _on_frame(self, child: _Child, payload: bytes) -> None:
        if child.state == "starting":
            hello = self._hello.decode(payload)
            if hello.error is not None:
                raise ConfigError(hello.error)
            child.state = "idle"
            child.deadline = float("inf")
        elif child.state == "busy" and child.index is not None:
            self._outcomes[child.index] = self._outcome.decode(payload)
            child.state = "idle"
            child.index = None
            child.deadline = float("inf")
        else:
            self._on_broken(child, "sent a frame while it was asked for nothing")

    def _on_death(self, child: _Child) -> None:
        """Its pipe ended or its process exited: reaped, and replaced."""
        with contextlib.suppress(OSError):
            child.process.kill()  # a pipe may end before its process does
        self._reap(child, REAP_S)
        self._replace(child, self._died(child))

    def _died(self, child: _Child) -> str:
        how = exit_said(child.process.poll())
        if child.state == "starting":
            raise RewardFunctionError(
                f"{self.spec.where}: a reward process died ({how}) before its function loaded; "
                "its stderr is in the worker's log"
            )
        return (
            f"{self.spec.where}: the reward process died ({how}) while scoring {self._which(child)}"
        )

    def _on_deadline(self, child: _Child) -> None:
        if child.state == "starting":
            raise RewardFunctionError(
                f"{self.spec.where}: a reward process did not load its function within "
                f"{self.start_timeout_s:g} s (engine.task.reward: importing the file hangs?)"
            )
        with contextlib.suppress(OSError):
            child.process.kill()
        self._reap(child, REAP_S)
        self._replace(
            child,
            f"{self.spec.where} timed out after {self.spec.timeout_s:g} s on "
            f"{self._which(child)} (its process was killed; a fresh one took its place)",
        )

    def _on_broken(self, child: _Child, what: str) -> None:
        with contextlib.suppress(OSError):
            child.process.kill()
        self._reap(child, REAP_S)
        if child.state == "starting":
            raise RewardFunctionError(f"{self.spec.where}: a starting reward process {what}")
        self._replace(child, f"{self.spec.where}: the reward process {what}")

    def _which(self, child: _Child) -> str:
        if child.index is None:
            return "nothing"
        call = self._calls[child.index]
        return f"sample {call.sample_id} (row {call.row_index})"

    def _replace(self, child: _Child, error: str) -> None:
        """`child` (already reaped) leaves the pool, its call's outcome `error`; a fresh process
        takes its place (its start has a deadline of its own)."""
        if child.state == "busy" and child.index is not None:
            self._outcomes[child.index] = RewardOutcome(
                score=None, error=error, seconds=time.monotonic() - child.dispatched
            )
        self._children.remove(child)
        self._start()

    # -- processes ---------------------------------------------------------------------------------

    def _start(self) -> None:
        args = ChildArgs(
            path=self.spec.path,
            name=self.spec.name,
            base_dir=str(self.base_dir),
            parent_pid=os.getpid(),
            columns=self.columns,
        )
        # The child runs the timeshare this process runs, wherever it was imported from.
        root = str(Path(__file__).resolve().parents[2])  # (the directory holding timeshare/)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "timeshare.task.reward_child",
                msgspec.json.encode(args).decode(),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        child = _Child(process, time.monotonic() + self.start_timeout_s)
        self._children.append(child)
        self._selector.register(child.stdout, selectors.EVENT_READ, child)

    def _reap(self, child: _Child, timeout: float) -> None:
        """Wait for `child` to end (killing it past `timeout`); its pipes closed."""
        for pipe in (child.stdin, child.stdout):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(pipe)
        try:
            child.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                child.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=REAP_S)
        for pipe in (child.stdin, child.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
