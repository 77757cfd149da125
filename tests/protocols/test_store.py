"""The job store from the event loop, on a real TCPStore on loopback."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from timeshare.errors import StoreError
from timeshare.protocols.store import AsyncJobStore, JobStore, state_key
from timeshare.state import initial_state


class Counting:
    """Wraps a connection's `put`: how many calls ran at once, at most."""

    def __init__(self, store: JobStore) -> None:
        self._put = store.put
        self._lock = threading.Lock()
        self.running = self.most = 0

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.01)  # long enough for every other call to have been started
            self._put(key, value)
        finally:
            with self._lock:
                self.running -= 1


@pytest.mark.asyncio
async def test_calls_made_together_take_one_thread_at_a_time_and_all_land() -> None:
    blocking = JobStore.host()
    store = AsyncJobStore(blocking)
    counting = Counting(blocking)
    blocking.put = counting.put  # type: ignore[method-assign]
    async with anyio.create_task_group() as group:
        for n in range(20):
            group.start_soon(store.put, f"key/{n}", {"n": n})
    assert counting.most == 1
    assert [blocking.get(f"key/{n}", timeout_s=1.0) for n in range(20)] == [
        {"n": n} for n in range(20)
    ]


@pytest.mark.asyncio
async def test_a_nodes_published_state_reads_back_typed_and_a_value_of_another_shape_is_named() -> (
    None
):
    blocking = JobStore.host()
    await AsyncJobStore(blocking).publish(initial_state(2, nodes=2, first_rank=2), node=1)
    published = blocking.published(1, timeout_s=5.0)
    assert (published.node, published.step, published.lifecycle) == (1, 0, "starting")
    blocking.put(state_key(0), {"node": "zero"})
    with pytest.raises(StoreError, match=r"state/node/0: not a node's state: Expected `int`"):
        blocking.published(0, timeout_s=5.0)
