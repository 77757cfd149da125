"""The trainer worker's event loop, run on its main thread for as long as a SYNC sends.

The weight sender is async; the worker's calls arrive on its main thread, blocking. A loop in a
thread of its own (a blocking portal) costs two thread hops a SYNC, into the loop and back:
0.2 ms each on a quiet machine, up to a millisecond when the other core has to be woken. Here the
main thread runs the loop itself, only while a coroutine runs.

The driver's abort is a signal to the main thread. Raised inside the loop's own machinery it
would leave the loop broken, so while a coroutine runs the abort only schedules that
coroutine's cancellation: the sender then tells its receiver (as on any failure) and the call
ends with `Aborted`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TypeVar

import anyio

from timeshare.errors import Aborted
from timeshare.protocols.commands import WorkerServer

T = TypeVar("T")
Job = Callable[[], Coroutine[object, object, None]]  # runs one coroutine, settles its future


class MainThreadLoop:
    """Runs coroutines to completion on the calling thread, one at a time, abortable.

    Every coroutine runs inside one long-lived task: anyio keeps its worker threads for as long
    as the task that started them (a fresh thread each SYNC would cost another 0.2 ms).
    """

    def __init__(self, server: WorkerServer) -> None:
        self._server = server
        self._loop = asyncio.new_event_loop()
        self._jobs: asyncio.Queue[Job | None] = asyncio.Queue()
        self._scope: anyio.CancelScope | None = None  # the running job's
        self._aborted = False  # the running job's
        self._host = self._loop.create_task(self._host_jobs())

    def run(self, coroutine: Callable[[], Awaitable[T]], what: str) -> T:
        """`coroutine()`'s result; `Aborted` (naming `what`) if the driver aborts it."""
        done: asyncio.Future[T] = self._loop.create_future()

        async def job() -> None:
            with anyio.CancelScope() as self._scope:
                if self._aborted:  # before the job began
                    self._scope.cancel()
                try:
                    done.set_result(await coroutine())
                except Exception as exc:  # the caller's to raise
                    done.set_exception(exc)
            self._scope = None
            if not done.done():  # cancelled by the abort (the only canceller of this scope)
                done.set_exception(Aborted(f"{what} aborted by the driver"))

        self._aborted = False
        self._jobs.put_nowait(job)
        schedule = self._loop.call_soon_threadsafe  # safe in a signal handler: it only queues
        with self._server.aborting_with(lambda: schedule(self._abort)):
            result = self._loop.run_until_complete(done)
        if self._aborted:
            raise Aborted(f"{what} aborted by the driver")
        return result

    def close(self) -> None:
        try:
            self._jobs.put_nowait(None)
            self._loop.run_until_complete(self._host)
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        finally:
            self._loop.close()

    def _abort(self) -> None:
        self._aborted = True
        if self._scope is not None:
            self._scope.cancel()

    async def _host_jobs(self) -> None:
        while (job := await self._jobs.get()) is not None:
            await job()
