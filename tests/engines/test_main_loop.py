"""The trainer's event loop on the worker's main thread: results, errors, abort, kept threads.

The server below is a stand-in for `WorkerServer.aborting_with` (the real one is driven end to
end in test_worker.py); the abort here is a real signal to this process's main thread.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import cast

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from timeshare.engines.main_loop import MainThreadLoop
from timeshare.errors import Aborted
from timeshare.protocols.commands import WorkerServer


class AbortingServer:
    """Calls the abort it was given when SIGUSR1 arrives, as WorkerServer does."""

    def __init__(self) -> None:
        self.abort: Callable[[], object] | None = None

    @contextmanager
    def aborting_with(self, abort: Callable[[], object]) -> Iterator[None]:
        self.abort = abort
        try:
            yield
        finally:
            self.abort = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.abort is not None:
            self.abort()


@pytest.fixture
def server() -> Iterator[AbortingServer]:
    server = AbortingServer()
    previous = signal.signal(signal.SIGUSR1, server.on_signal)
    try:
        yield server
    finally:
        signal.signal(signal.SIGUSR1, previous)


def loop_for(server: AbortingServer) -> MainThreadLoop:
    return MainThreadLoop(cast(WorkerServer, server))


def test_results_and_errors_come_back_and_the_loop_stays_usable(server: AbortingServer) -> None:
    loop = loop_for(server)
    try:

        async def answer() -> int:
            await anyio.lowlevel.checkpoint()
            return 42

        async def fail() -> int:
            raise ValueError("bad weights")

        assert loop.run(answer, "sync") == 42
        with pytest.raises(ValueError, match="bad weights"):
            loop.run(fail, "sync")
        assert loop.run(answer, "sync") == 42
    finally:
        loop.close()


def test_worker_threads_are_kept_from_one_run_to_the_next(server: AbortingServer) -> None:
    loop = loop_for(server)
    try:

        async def thread_id() -> int:
            return await anyio.to_thread.run_sync(threading.get_ident)

        first = loop.run(thread_id, "sync")
        assert loop.run(thread_id, "sync") == first != threading.get_ident()
    finally:
        loop.close()
    # Closing stops it: anyio tells the thread to end as its host task ends, and it does soon.
    deadline = time.monotonic() + 10.0
    while first in {t.ident for t in threading.enumerate()}:
        assert time.monotonic() < deadline, "the worker thread outlived the loop"
        time.sleep(0.01)


def test_a_signal_aborts_a_waiting_run_which_cleans_up_first(server: AbortingServer) -> None:
    loop = loop_for(server)
    cleaned = threading.Event()

    async def wait_long() -> None:
        try:
            await anyio.sleep(30)
        finally:
            cleaned.set()

    async def answer() -> str:
        return "again"

    signaller = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        signaller.start()
        started = time.monotonic()
        with pytest.raises(Aborted, match="sync aborted by the driver"):
            loop.run(wait_long, "sync")
        assert time.monotonic() - started < 5.0
        assert cleaned.is_set()
        assert loop.run(answer, "sync") == "again"
    finally:
        signaller.join()
        loop.close()
