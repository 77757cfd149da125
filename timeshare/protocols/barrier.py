"""Store-based barriers with deadlines: every rank learns which ranks are missing.

A barrier named `name` is passed in generations: the k-th time a rank waits on `name` it joins
generation k. A rank arrives by writing its value under the generation and counting itself in
(one atomic add). The rank that makes the count whole wakes every other rank at once, writing
each one's wake key in one request; every other rank blocks in the store's own wait on its wake
key. Nothing polls: a barrier costs each rank a few requests however long it waits, and the
last rank's arrival releases the others within one round trip.

From async code the whole arrival, wait and read of the values is one call in a worker thread
(each hop between the event loop and a thread costs more CPU than the request it carries). Its
deadline and its cancellation write the rank's own wake key from a second connection (`waker`),
so the thread returns at once and none is left behind. Unlike a gloo `monitored_barrier`, a
timeout leaves the store usable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

import anyio

from timeshare.errors import CollectiveTimeout, StoreError
from timeshare.protocols.store import JobStore, Json

# What the last rank to arrive makes of every rank's value (in rank order), for all of them.
Fold = Callable[[list[Json]], Json]
WAKE_S = 5.0  # for writing a rank's own wake key (its deadline, its cancellation)
BACKSTOP_S = 30.0  # the store's own wait outlasts the deadline: the waker ends it first


@dataclass
class Barrier:
    """One rank's handle on the job's barriers: one waiter at a time, on its own connection.

    A blocked wait holds its connection, so ranks served by one process (the driver of a node)
    each need their own `JobStore`; `waker` (any other connection, shared or not) is needed by
    the async waits only, to end the wait of a deadline passed or a task cancelled.
    """

    store: JobStore
    rank: int
    world_size: int
    waker: JobStore | None = None
    _generations: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")

    def wait_blocking(self, name: str, *, timeout_s: float) -> int:
        """Arrive at barrier `name` and wait for every rank; return its generation."""
        generation = self._next(name)
        try:
            self._arrive_and_wait(name, generation, True, timeout_s, None)
        except TimeoutError as exc:
            raise self._timeout(name, generation, timeout_s) from exc
        return generation

    async def wait(self, name: str, *, timeout_s: float, value: object = True) -> int:
        """Like `wait_blocking`, for the event loop: cancellable at once, no thread left behind.
        `value` (JSON) is what this rank brings; `values` reads what every rank brought."""
        generation = self._next(name)
        await self._meet(name, generation, value, timeout_s, None)
        return generation

    async def agree(
        self,
        name: str,
        *,
        timeout_s: float,
        value: object | Callable[[JobStore], object],
        fold: Fold,
    ) -> Json:
        """Arrive with `value` (JSON), wait for every rank, and return `fold` of what every rank
        brought (in rank order): one worker thread for all of it.

        The last rank to arrive reads every value and folds them, once for the job, and wakes
        each rank with the result: a rank reads one small value, not every rank's (at a thousand
        ranks, n reads of n values each would be n^2). `fold` must give every rank the same
        answer it would have found itself. A callable `value` is asked for the value in the
        thread, with the barrier's connection (as fresh as the arrival, at no hop of its own)."""
        generation = self._next(name)
        return await self._meet(name, generation, value, timeout_s, fold)

    def values(self, name: str, generation: int) -> list[Json]:
        """What every rank brought to a generation all of them reached, in rank order."""
        return self.store.read_many([_key(name, generation, r) for r in range(self.world_size)])

    # -- the async wait --------------------------------------------------------------------------

    async def _meet(
        self,
        name: str,
        generation: int,
        value: object | Callable[[JobStore], object],
        timeout_s: float,
        fold: Fold | None,
    ) -> Json:
        """Arrive and wait in one worker thread, while a task of the loop stands ready to wake
        it: at the deadline, or when this wait is cancelled."""
        if self.waker is None:
            raise RuntimeError("an async barrier wait needs a second connection (`waker`)")
        woken: list[str] = []  # why this rank woke itself, if it did: "deadline", "cancelled"
        waiting, started = True, False

        def arrive_and_wait() -> _Agreed | CollectiveTimeout | None:
            nonlocal started
            started = True
            brought = value(self.store) if callable(value) else value
            try:
                agreed = self._arrive_and_wait(
                    name, generation, brought, timeout_s + BACKSTOP_S, fold
                )
            except TimeoutError:  # the store's own backstop: the waker could not end the wait
                return self._timeout(name, generation, timeout_s)
            if agreed is not None:
                return agreed
            if woken == ["deadline"]:
                return self._timeout(name, generation, timeout_s)
            return None  # cancelled

        async def wake_when_due() -> None:
            try:
                await anyio.sleep(timeout_s)
                woken.append("deadline")
            except anyio.get_cancelled_exc_class():
                if waiting:
                    woken.append("cancelled")
                raise
            finally:
                if waiting:
                    await self._wake_self(name, generation)

        result: _Agreed | CollectiveTimeout | None = None
        failure: Exception | None = None  # raised below, outside the group (not as a group)
        async with anyio.create_task_group() as group:
            group.start_soon(wake_when_due)
            try:
                result = await anyio.to_thread.run_sync(arrive_and_wait)
            except anyio.get_cancelled_exc_class():
                if not started:  # cancelled before it arrived: the next wait is this generation
                    self._generations[name] -= 1
                raise
            except Exception as exc:  # the store gone, mostly
                failure = exc
            finally:
                waiting = False
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if isinstance(result, CollectiveTimeout):
            raise result
        if result is None:
            await anyio.lowlevel.checkpoint()  # the cancellation that woke it, raised here
            raise RuntimeError("a barrier's wait ended uncancelled without every rank")
        return result.value

    async def _wake_self(self, name: str, generation: int) -> None:
        """End this rank's own wait on `generation` (shielded: it runs as the wait is cancelled)."""
        assert self.waker is not None
        # (A store gone ends the wait too, failing: nothing to wake then.)
        wake, itself = _wake(name, generation, self.rank), {"woken": "itself"}
        with anyio.CancelScope(shield=True), anyio.move_on_after(WAKE_S), suppress(StoreError):
            await anyio.to_thread.run_sync(self.waker.put, wake, itself)

    # -- the protocol ----------------------------------------------------------------------------

    def _next(self, name: str) -> int:
        self._generations[name] += 1
        return self._generations[name]

    def _arrive_and_wait(
        self,
        name: str,
        generation: int,
        value: object,
        wait_s: float,
        fold: Fold | None,
    ) -> _Agreed | None:
        """Arrive at `generation`; the last rank to arrive folds every value and wakes every
        other with the result. The result once every rank arrived; None when this rank's wait
        was ended by its own wake. Blocking; a wait past `wait_s` is `TimeoutError`."""
        # Our keys of two generations back go first, while the store is quiet: after the wake,
        # every other rank's requests (woken, arriving at the next) queue before ours.
        self._forget(name, generation - 2)
        self.store.put(_key(name, generation, self.rank), value)
        arrived = self.store.add(_count(name, generation), 1)
        wake = _wake(name, generation, self.rank)
        if arrived >= self.world_size:
            agreed = self._fold(name, generation, fold)
            others = [_wake(name, generation, rank) for rank in range(self.world_size)]
            self.store.put_many({key: {"agreed": agreed.value} for key in others if key != wake})
        else:
            self.store.wait([wake], timeout_s=wait_s)
            woke_to = self.store.read(wake)
            if isinstance(woke_to, dict) and "agreed" in woke_to:
                agreed = _Agreed(woke_to["agreed"])
            elif self.store.add(_count(name, generation), 0) >= self.world_size:
                agreed = self._fold(name, generation, fold)  # all came as it woke itself
            else:
                return None
        return agreed

    def _fold(self, name: str, generation: int, fold: Fold | None) -> _Agreed:
        return _Agreed(None if fold is None else fold(self.values(name, generation)))

    def _forget(self, name: str, generation: int) -> None:
        """Our keys of `generation` are read by nobody now: every rank has arrived at the one
        after it (we are arriving at the one after that), so it is done reading its values.
        (The previous generation may still be read by a rank that was woken and reads the
        values next.)"""
        if generation < 1:
            return
        self.store.delete(_key(name, generation, self.rank))
        self.store.delete(_wake(name, generation, self.rank))
        if self.rank == 0:
            self.store.delete(_count(name, generation))

    def _timeout(self, name: str, generation: int, timeout_s: float) -> CollectiveTimeout:
        keys = [_key(name, generation, rank) for rank in range(self.world_size)]
        missing = [rank for rank, key in enumerate(keys) if not self.store.has(key)]
        return CollectiveTimeout(
            f"barrier {name!r} (generation {generation}) timed out after {timeout_s:g} s on "
            f"rank {self.rank}: ranks {missing} did not arrive",
            name=name,
            generation=generation,
            missing=missing,
        )


@dataclass(frozen=True)
class _Agreed:
    """What a generation every rank reached came to (`fold`'s result; None without one)."""

    value: Json


def _key(name: str, generation: int, rank: int) -> str:
    return f"barrier/{name}/{generation}/{rank}"


def _count(name: str, generation: int) -> str:
    return f"barrier/{name}/{generation}/count"


def _wake(name: str, generation: int, rank: int) -> str:
    return f"barrier/{name}/{generation}/wake/{rank}"
