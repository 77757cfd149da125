"""Store-based barriers with deadlines: every rank learns which ranks are missing.

A barrier named `name` is passed in generations: the k-th time a rank waits on `name` it joins
generation k. It writes its arrival under that generation, then waits for the others' keys with
a deadline. The wait runs in a worker thread from async code and always ends by its deadline, so
no thread is left behind. Unlike a gloo `monitored_barrier`, a timeout leaves the store usable.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import anyio

from timeshare.errors import CollectiveTimeout
from timeshare.protocols.store import JobStore


@dataclass
class Barrier:
    """One rank's handle on the job's barriers (not thread-safe: one waiter at a time)."""

    store: JobStore
    rank: int
    world_size: int
    _generations: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")

    def wait_blocking(self, name: str, *, timeout_s: float) -> int:
        """Arrive at barrier `name` and wait for every rank; return its generation."""
        self._generations[name] += 1
        generation = self._generations[name]
        self.store.put(_key(name, generation, self.rank), True)
        if generation > 1:  # our arrival at the previous generation is no longer read by anyone
            self.store.delete(_key(name, generation - 1, self.rank))
        keys = [_key(name, generation, r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, timeout_s=timeout_s)
        except TimeoutError as exc:
            missing = [r for r, key in enumerate(keys) if not self.store.has(key)]
            raise CollectiveTimeout(
                f"barrier {name!r} (generation {generation}) timed out after {timeout_s:g} s on "
                f"rank {self.rank}: ranks {missing} did not arrive",
                name=name,
                generation=generation,
                missing=missing,
            ) from exc
        return generation

    async def wait(self, name: str, *, timeout_s: float) -> int:
        """`wait_blocking` in a worker thread; the event loop goes on meanwhile."""
        # Not abandoned on cancel: the wait ends by its own deadline, and its thread with it.
        return await anyio.to_thread.run_sync(lambda: self.wait_blocking(name, timeout_s=timeout_s))


def _key(name: str, generation: int, rank: int) -> str:
    return f"barrier/{name}/{generation}/{rank}"
