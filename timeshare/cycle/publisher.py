"""Where this node's part of the job stands, written to the job store for every node and operator
(`state_key`) by a thread of its own.

The cycle hands each new state over and goes on: a hop into a worker thread and back for every
phase cost the daemon more CPU than the write it carried (benchmarks/scale.py). Only the newest
state is written; one overtaken before its turn is skipped. A store gone is logged once and
otherwise left to the command watch and the beat, which end the run for it (cycle/nodes.py).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import structlog

from timeshare.errors import StoreError
from timeshare.protocols.store import JobStore, state_key, state_record
from timeshare.state import JobState

log = structlog.get_logger(__name__)

FLUSH_S = 5.0  # for the last state's write, as the run ends


class StatePublisher:
    """Writes the newest state handed to `publish`, from its own thread, while `running`."""

    def __init__(self, store: JobStore, node: int) -> None:
        self.store = store
        self.node = node
        self._newest: JobState | None = None
        self._wake = threading.Event()
        self._closing = False
        self._warned = False

    def publish(self, state: JobState) -> None:
        """Hand `state` over; it is written soon, unless a newer one overtakes it."""
        self._newest = state
        self._wake.set()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[StatePublisher]:
        """The thread, for the span of a run; on the way out the newest state is written (within
        FLUSH_S) and the thread is joined."""
        thread = threading.Thread(target=self._write_until_closed, name="ts-publish", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._closing = True
            self._wake.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join, FLUSH_S)
            if thread.is_alive():  # a store that stopped answering: its calls time out later
                log.warning("cycle.state.unpublished", error=f"not written in {FLUSH_S:g} s")

    def _write_until_closed(self) -> None:
        written: JobState | None = None
        while True:
            self._wake.wait()
            self._wake.clear()
            newest = self._newest
            if newest is not None and newest is not written:
                self._write(newest)
                written = newest
            if self._closing and self._newest is written:
                return

    def _write(self, state: JobState) -> None:
        try:
            self.store.put(state_key(self.node), state_record(state, node=self.node))
        except StoreError as exc:
            if not self._warned:  # (the run ends for it elsewhere: say it once)
                log.warning("cycle.state.unpublished", error=str(exc))
                self._warned = True
