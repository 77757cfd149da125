"""Store-based barriers with deadlines: every rank learns which ranks are missing.

A barrier named `name` is passed in generations: the k-th time a rank waits on `name` it joins
generation k. It writes its arrival under that generation, then waits for the others' keys with
a deadline. From async code the wait polls, so a cancellation ends it at once and no thread is
left behind. Unlike a gloo `monitored_barrier`, a timeout leaves the store usable.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from timeshare.errors import CollectiveTimeout
from timeshare.protocols.store import JobStore

FIRST_POLL_S = 0.0005
QUICK_POLLS_S = 0.005  # ranks that finish a phase together arrive within this: poll fast
POLL_S = 0.02


@dataclass
class Barrier:
    """One rank's handle on the job's barriers: one waiter at a time, on its own connection.

    Blocking waits on one store connection queue behind each other, so ranks served by one
    process (the driver of a node) each need their own `JobStore`.
    """

    store: JobStore
    rank: int
    world_size: int
    _generations: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")

    def wait_blocking(self, name: str, *, timeout_s: float) -> int:
        """Arrive at barrier `name` and wait for every rank; return its generation."""
        generation, keys = self._arrive(name, True)
        try:
            self.store.wait(keys, timeout_s=timeout_s)
        except TimeoutError as exc:
            raise self._timeout(name, generation, keys, timeout_s) from exc
        return generation

    async def wait(self, name: str, *, timeout_s: float, value: Any = True) -> int:
        """Like `wait_blocking`, for the event loop: cancellable at once, no thread left behind.
        `value` (JSON) is what this rank brings; `values` reads what every rank brought.

        It polls the store (a ~0.1 ms round trip in a worker thread) every POLL_S rather than
        blocking a thread for the whole wait, which a cancellation could not interrupt.
        """
        generation, keys = await anyio.to_thread.run_sync(self._arrive, name, value)
        quick_until = anyio.current_time() + QUICK_POLLS_S
        pause = FIRST_POLL_S
        with anyio.move_on_after(timeout_s):
            while not await anyio.to_thread.run_sync(self.store.has_all, keys):
                await anyio.sleep(pause)
                if anyio.current_time() > quick_until:  # quick when ranks are close, cheap when not
                    pause = min(pause * 2, POLL_S)
            return generation
        # Naming the missing ranks asks the store once per rank: in a thread too.
        raise await anyio.to_thread.run_sync(self._timeout, name, generation, keys, timeout_s)

    def values(self, name: str, generation: int) -> list[Any]:
        """What every rank brought to a generation all of them reached, in rank order."""
        return self.store.read_many([_key(name, generation, r) for r in range(self.world_size)])

    def _arrive(self, name: str, value: Any) -> tuple[int, list[str]]:
        self._generations[name] += 1
        generation = self._generations[name]
        self.store.put(_key(name, generation, self.rank), value)
        # Our arrival two generations back is read by nobody now: every rank has arrived at the
        # previous one, so it is done reading that one's values. (The previous one may still be
        # read by a rank that saw everyone arrive and reads the values next.)
        if generation > 2:
            self.store.delete(_key(name, generation - 2, self.rank))
        return generation, [_key(name, generation, r) for r in range(self.world_size)]

    def _timeout(
        self, name: str, generation: int, keys: list[str], timeout_s: float
    ) -> CollectiveTimeout:
        missing = [rank for rank, key in enumerate(keys) if not self.store.has(key)]
        return CollectiveTimeout(
            f"barrier {name!r} (generation {generation}) timed out after {timeout_s:g} s on "
            f"rank {self.rank}: ranks {missing} did not arrive",
            name=name,
            generation=generation,
            missing=missing,
        )


def _key(name: str, generation: int, rank: int) -> str:
    return f"barrier/{name}/{generation}/{rank}"
