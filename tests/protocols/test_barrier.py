"""The job store and its barriers across real processes on a loopback TCPStore."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from timeshare.errors import CollectiveTimeout, StoreError
from timeshare.protocols.barrier import Barrier
from timeshare.protocols.store import JobCommand, JobStore

ROOT = Path(__file__).resolve().parents[2]


def start_rank(store: JobStore, rank: int, world_size: int, **args: Any) -> subprocess.Popen[str]:
    host, port = store.address
    spec = {"host": host, "port": port, "rank": rank, "world_size": world_size, **args}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.protocols.barrier_rank", json.dumps(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def results(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.slow
def test_every_rank_learns_who_is_missing_and_the_store_stays_usable() -> None:
    store = JobStore.host()
    plan = [["all", 60.0], ["partial", 3.0], ["again", 60.0]]
    # Ranks 1..3 in their own processes; rank 3 skips "partial". Rank 0 is this process.
    procs = [
        start_rank(store, rank, 4, plan=plan, skip=["partial"] if rank == 3 else [])
        for rank in (1, 2, 3)
    ]
    barrier = Barrier(store, 0, 4)
    assert barrier.wait_blocking("all", timeout_s=60.0) == 1
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        barrier.wait_blocking("partial", timeout_s=3.0)
    assert time.monotonic() - started < 3.0 + 2.0
    assert info.value.missing == [3] and info.value.name == "partial"
    assert "ranks [3] did not arrive" in str(info.value)
    assert barrier.wait_blocking("again", timeout_s=60.0) == 1
    outcomes = [results(p) for p in procs]
    for rank, events in zip((1, 2), outcomes[:2], strict=True):
        assert events == [
            {"barrier": "all", "generation": 1},
            {"barrier": "partial", "missing": [3]},
            {"barrier": "again", "generation": 1},
        ], rank
    assert outcomes[2][1] == {"barrier": "partial", "skipped": True}
    assert outcomes[2][2] == {"barrier": "again", "generation": 1}


def test_generations_count_per_name_and_old_arrivals_are_removed() -> None:
    store = JobStore.host()
    barrier = Barrier(store, 0, 1)
    assert [barrier.wait_blocking("x", timeout_s=5.0) for _ in range(3)] == [1, 2, 3]
    assert barrier.wait_blocking("y", timeout_s=5.0) == 1
    # The previous generation stays (a rank may still read its values), the one before goes.
    assert not store.has("barrier/x/1/0") and store.has("barrier/x/2/0")
    assert store.has("barrier/x/3/0")


@pytest.mark.asyncio
async def test_each_rank_learns_what_every_rank_brought() -> None:
    store = JobStore.host()
    barriers = [Barrier(JobStore.connect(*store.address), rank, 3, store) for rank in range(3)]
    generations: list[int] = []

    async def arrive(barrier: Barrier) -> None:
        generations.append(
            await barrier.wait("values", timeout_s=10.0, value={"rank": barrier.rank})
        )

    async with anyio.create_task_group() as group:
        for barrier in barriers:
            group.start_soon(arrive, barrier)
    assert generations == [1, 1, 1]
    assert barriers[2].values("values", 1) == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


@pytest.mark.asyncio
async def test_async_wait_keeps_the_event_loop_running() -> None:
    store = JobStore.host()
    barrier = Barrier(JobStore.connect(*store.address), 0, 2, store)  # rank 1 never comes
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        with pytest.raises(CollectiveTimeout, match=r"ranks \[1\]"):
            await barrier.wait("lonely", timeout_s=0.5)
        group.cancel_scope.cancel()
    assert ticks >= 20


class CountingStore(JobStore):
    """A real connection that counts the requests a barrier makes on it, and its reads of
    every rank's value."""

    def __init__(self, store: JobStore) -> None:
        super().__init__(JobStore.connect(*store.address).raw, leader=False)
        self.requests = 0
        self.reads_of_every_value = 0

    def put(self, key: str, value: Any) -> None:
        self.requests += 1
        super().put(key, value)

    def add(self, key: str, amount: int) -> int:
        self.requests += 1
        return super().add(key, amount)

    def wait(self, keys: list[str], *, timeout_s: float) -> None:
        self.requests += 1
        super().wait(keys, timeout_s=timeout_s)

    def read(self, key: str) -> Any:
        self.requests += 1
        return super().read(key)

    def read_many(self, keys: list[str]) -> list[Any]:
        self.requests += 1
        self.reads_of_every_value += 1
        return super().read_many(keys)


def total(values: list[Any]) -> dict[str, Any]:
    return {"n": sum(value["n"] for value in values), "ranks": len(values)}


@pytest.mark.asyncio
async def test_a_long_wait_asks_the_store_a_few_times_and_never_polls() -> None:
    store = JobStore.host()
    early = Barrier(CountingStore(store), 0, 2, store)
    late = Barrier(CountingStore(store), 1, 2, store)
    agreed: list[Any] = []

    async def arrive_early() -> None:
        agreed.append(await early.agree("slow", timeout_s=30.0, value={"n": 1}, fold=total))

    async with anyio.create_task_group() as group:
        group.start_soon(arrive_early)
        await anyio.sleep(1.0)  # rank 0 waits a second: a poller would have asked dozens of times
        last = await late.agree("slow", timeout_s=30.0, value={"n": 2}, fold=total)
    assert last == {"n": 3, "ranks": 2} and agreed == [last]
    # Rank 0 arrived (put, add), waited, and read the result the last rank woke it with; only
    # the last rank read every rank's value, once for the job.
    assert isinstance(early.store, CountingStore) and isinstance(late.store, CountingStore)
    assert early.store.requests <= 4 and early.store.reads_of_every_value == 0
    assert late.store.reads_of_every_value == 1


class RecordingStore(CountingStore):
    """A counting connection that also keeps the order of the requests that change keys."""

    def __init__(self, store: JobStore) -> None:
        super().__init__(store)
        self.changes: list[str] = []

    def put(self, key: str, value: Any) -> None:
        self.changes.append(f"put {key}")
        super().put(key, value)

    def put_many(self, items: dict[str, Any]) -> None:
        self.changes.append("wake the others")
        super().put_many(items)

    def delete(self, key: str) -> None:
        self.changes.append(f"delete {key}")
        super().delete(key)


@pytest.mark.asyncio
async def test_the_last_rank_asks_nothing_more_once_it_has_woken_the_others() -> None:
    """Woken, every other rank's requests reach the store at once (reads, the next arrival):
    a request the last rank made after its wake would queue behind them all. Its clean-up of
    two generations back comes first, as it arrives."""
    store = JobStore.host()
    early = Barrier(JobStore.connect(*store.address), 0, 2, store)
    late = Barrier(RecordingStore(store), 1, 2, store)
    for generation in (1, 2, 3):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(early.agree, "x", timeout_s=30.0, value={"n": 1}, fold=total))
            for _ in range(1000):  # until rank 0 has arrived (10 s at most): rank 1 comes last
                if store.has(f"barrier/x/{generation}/0"):
                    break
                await anyio.sleep(0.01)
            await late.agree("x", timeout_s=30.0, value={"n": 2}, fold=total)
    assert isinstance(late.store, RecordingStore)
    assert late.store.changes[-4:] == [
        "delete barrier/x/1/1",
        "delete barrier/x/1/wake/1",
        "put barrier/x/3/1",
        "wake the others",
    ]


@pytest.mark.asyncio
async def test_a_rank_that_woke_itself_as_the_last_came_folds_the_values_itself() -> None:
    """The race of a rank's own wake (its deadline) with the last rank's: every rank had
    arrived, so it agrees all the same, on the values as written."""
    store = JobStore.host()
    barrier = Barrier(JobStore.connect(*store.address), 0, 2, store)
    agreed: list[Any] = []

    async def arrive() -> None:
        agreed.append(await barrier.agree("race", timeout_s=30.0, value={"n": 1}, fold=total))

    async with anyio.create_task_group() as group:
        group.start_soon(arrive)
        for _ in range(1000):  # until rank 0 has arrived (10 s at most)
            if store.has("barrier/race/1/0"):
                break
            await anyio.sleep(0.01)
        store.put("barrier/race/1/1", {"n": 2})  # rank 1 arrives, and its wake is overtaken
        store.add("barrier/race/1/count", 1)
        store.put("barrier/race/1/wake/0", {"woken": "itself"})
    assert agreed == [{"n": 3, "ranks": 2}]


@pytest.mark.asyncio
async def test_a_cancelled_wait_ends_at_once_and_the_barrier_goes_on() -> None:
    store = JobStore.host()
    barriers = [Barrier(JobStore.connect(*store.address), rank, 2, store) for rank in range(2)]
    started = time.monotonic()
    with anyio.move_on_after(0.3):
        await barriers[0].wait("x", timeout_s=60.0)  # rank 1 not there yet: cancelled
    assert time.monotonic() - started < 5.0  # not the 60 s deadline, nor the store's backstop
    # Rank 0 had arrived: rank 1's first wait meets that arrival and passes at once.
    assert await barriers[1].wait("x", timeout_s=5.0) == 1
    # Rank 0's thread is gone and its connection free: both meet again at generation 2.
    async with anyio.create_task_group() as group:
        group.start_soon(partial(barriers[1].wait, "x", timeout_s=30.0))
        assert await barriers[0].wait("x", timeout_s=30.0) == 2


@pytest.mark.asyncio
async def test_a_wait_cancelled_before_it_arrives_does_not_use_up_a_generation() -> None:
    store = JobStore.host()
    barrier = Barrier(JobStore.connect(*store.address), 0, 1, store)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await barrier.wait("y", timeout_s=5.0)
    assert not store.has("barrier/y/1/0")
    assert await barrier.wait("y", timeout_s=5.0) == 1


def test_store_values_commands_and_generations() -> None:
    leader = JobStore.host()
    host, port = leader.address
    follower = JobStore.connect(host, port, timeout_s=10.0)
    assert [leader.next_generation("g"), follower.next_generation("g")] == [1, 2]
    generation = follower.record_command("steps", steps=12)
    assert leader.command(generation, timeout_s=5.0) == JobCommand(command="steps", steps=12)
    assert leader.latest_command() == generation
    leader.put(f"command/{generation + 1}", ["not", "a", "command"])
    assert leader.command(generation + 1, timeout_s=5.0) is None
    leader.put("phase", {"step": 3, "phase": "sync"})
    assert follower.get("phase", timeout_s=5.0) == {"step": 3, "phase": "sync"}
    with pytest.raises(TimeoutError, match="not written within"):
        follower.get("never", timeout_s=0.2)


def test_many_values_are_read_in_one_request_and_missing_ones_are_none() -> None:
    leader = JobStore.host()
    host, port = leader.address
    follower = JobStore.connect(host, port, timeout_s=10.0)
    for node in range(50):
        leader.put(f"record/{node}", {"node": node})
    keys = [f"record/{node}" for node in range(50)]
    assert follower.read_many(keys) == [{"node": node} for node in range(50)]
    assert follower.read_many([]) == []
    assert follower.read_present([*keys[:2], "record/none", keys[3]]) == [
        {"node": 0},
        {"node": 1},
        None,
        {"node": 3},
    ]
    assert follower.read_present(keys[:3]) == [{"node": n} for n in range(3)]


def test_an_unreachable_store_is_a_clear_error() -> None:
    with pytest.raises(StoreError, match=r"cannot reach the job store at 127.0.0.1:1 within"):
        JobStore.connect("127.0.0.1", 1, timeout_s=0.5)


def test_barrier_refuses_a_rank_outside_the_job() -> None:
    with pytest.raises(ValueError, match=r"rank 2 is not in 0..1"):
        Barrier(JobStore.host(), 2, 2)
