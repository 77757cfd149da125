"""The job store: the job's shared state on the `torch.distributed` TCPStore hosted by the leader.

Every daemon and worker of a job reaches the same store (the one torchrun uses). It holds
generation numbers, the current phase, and every command that changes the cycle, each written
under a fresh generation so that every node applies it at the same point. Values are JSON, never
pickle. Blocking calls here are meant for worker threads (see barrier.py); each has a deadline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

import anyio
import msgspec
import torch.distributed as dist

# torch.distributed re-exports these untyped
from torch._C._distributed_c10d import PrefixStore, TCPStore

from timeshare.cluster import ClusterSection
from timeshare.errors import StoreError
from timeshare.state import JobState

T = TypeVar("T")

PREFIX = "timeshare/"
COMMAND = "command"  # the generation counter and key prefix of cycle-changing commands


def state_key(node: int) -> str:
    """Where node `node`'s driver publishes where its part of the job stands."""
    return f"state/node/{node}"


def heard_key(generation: int, node: int) -> str:
    """Where node `node` says it read the command of `generation` while idle (a stop: the
    leader's daemon, which hosts the store, waits for it before it exits)."""
    return f"{COMMAND}/{generation}/heard/{node}"


# What the store holds under a key: a JSON value, read back as one (a reader converts it to
# its own type: msgspec.convert).
Json: TypeAlias = dict[str, "Json"] | list["Json"] | str | int | float | bool | None


@runtime_checkable
class _MultiSet(Protocol):
    """torch's `Store.multi_set`, which its type stub (torch/_C/_distributed_c10d.pyi) lacks;
    the binding's own signature (its __doc__): `multi_set(keys: Sequence[str], values:
    Sequence[str]) -> None`."""

    def multi_set(self, keys: Sequence[str], values: Sequence[str]) -> None: ...


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """Where one node's part of the job stands, as its driver publishes it (`state_key`)."""

    node: int
    lifecycle: str
    step: int
    phases: list[str]
    reason: str | None = None


class JobCommand(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A command that changes the cycle (pause, resume, drain, stop, steps, log_level), with
    what the one that takes a value takes."""

    command: str
    steps: int | None = None  # `steps`: the job's new step count
    level: str | None = None  # `log_level`: the workers' new log level


class JobStore:
    """A connection to the job store; the leader's instance also hosts it."""

    def __init__(self, store: TCPStore, *, leader: bool) -> None:
        self._store = store
        self.leader = leader

    @classmethod
    def host(cls, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0) -> JobStore:
        """Host the store (the leader daemon); port 0 picks a free one."""
        try:
            store = TCPStore(
                host,
                port,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            raise StoreError(f"cannot host the job store on {host}:{port}: {exc}") from exc
        return cls(store, leader=True)

    @classmethod
    def connect(cls, host: str, port: int, *, timeout_s: float = 30.0) -> JobStore:
        """Reach the leader's store, waiting at most `timeout_s` for it to come up."""
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            raise StoreError(
                f"cannot reach the job store at {host}:{port} within {timeout_s:g} s: {exc}"
            ) from exc
        return cls(store, leader=False)

    @property
    def address(self) -> tuple[str, int]:
        return self._store.host, self._store.port

    @property
    def raw(self) -> TCPStore:
        """The TCPStore itself, for barriers and for torch.distributed's own use."""
        return self._store

    def prefixed(self, prefix: str) -> PrefixStore:
        """The store under `prefix`, for a process group of torch.distributed's own
        (`init_process_group(store=...)`): its keys stay apart from the job's."""
        return PrefixStore(prefix, self._store)

    def next_generation(self, name: str) -> int:
        """A number no earlier call for `name` on any rank returned (1, 2, …)."""
        with self._mapped(f"gen/{name}"):
            return int(self._store.add(f"{PREFIX}gen/{name}", 1))

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer counter `key`; return the new value."""
        with self._mapped(key):
            return int(self._store.add(PREFIX + key, amount))

    def put(self, key: str, value: object) -> None:
        with self._mapped(key):
            self._store.set(PREFIX + key, json.dumps(value))

    def put_many(self, items: dict[str, object]) -> None:
        """Write every key of `items` in one request."""
        if not items:
            return
        with self._mapped(str(list(items))):
            keys = [PREFIX + key for key in items]
            store = self._store
            if not isinstance(store, _MultiSet):  # (was the AttributeError calling it)
                raise AttributeError(f"torch's {type(store).__name__} has no multi_set")
            store.multi_set(keys, [json.dumps(v) for v in items.values()])

    def get(self, key: str, *, timeout_s: float) -> Json:
        """The JSON value under `key`, waiting at most `timeout_s` for it to be written."""
        self.wait([key], timeout_s=timeout_s)
        return self.read(key)

    def read(self, key: str) -> Json:
        """The JSON value under `key`, which the caller knows is written (else the store's own
        timeout, then `StoreError`)."""
        with self._mapped(key):
            value: Json = json.loads(self._store.get(PREFIX + key))
            return value

    def read_many(self, keys: list[str]) -> list[Json]:
        """The JSON values under `keys`, all known to be written: one request for all of them
        (a crossing's values of every node, every node's record at a beat), not one each."""
        if not keys:
            return []
        with self._mapped(str(keys)):
            return [json.loads(raw) for raw in self._store.multi_get([PREFIX + k for k in keys])]

    def read_present(self, keys: list[str]) -> list[Json]:
        """The JSON value under each key, None where none is written yet: two requests once
        every key is written (the common case), one more per key before."""
        if self.has_all(keys):
            return self.read_many(keys)
        return [self.read(key) if self.has(key) else None for key in keys]

    def has(self, key: str) -> bool:
        with self._mapped(key):
            return bool(self._store.check([PREFIX + key]))

    def has_all(self, keys: list[str]) -> bool:
        """Whether every key is set: one round trip, however many keys."""
        with self._mapped(str(keys)):
            return bool(self._store.check([PREFIX + k for k in keys]))

    def delete(self, key: str) -> None:
        with self._mapped(key):
            self._store.delete_key(PREFIX + key)

    def wait(self, keys: list[str], *, timeout_s: float) -> None:
        """Block until every key exists; `TimeoutError` naming the keys after `timeout_s`."""
        try:
            self._store.wait([PREFIX + k for k in keys], timedelta(seconds=timeout_s))
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                raise TimeoutError(f"keys not written within {timeout_s:g} s: {keys}") from exc
            raise StoreError(f"job store failed while waiting for {keys}: {exc}") from exc
        except dist.DistError as exc:
            raise self._lost(str(keys), exc) from exc

    @contextmanager
    def _mapped(self, key: str) -> Iterator[None]:
        """torch's errors of a store operation (the leader gone, a reset connection) as ours."""
        try:
            yield
        except dist.DistError as exc:
            raise self._lost(key, exc) from exc

    def _lost(self, key: str, exc: BaseException) -> StoreError:
        host, port = self.address
        return StoreError(f"job store at {host}:{port} failed on {key}: {exc}")

    def published(self, node: int, *, timeout_s: float) -> Published:
        """Where node `node`'s part of the job stands, once its driver has said."""
        value = self.get(state_key(node), timeout_s=timeout_s)
        try:
            return msgspec.convert(value, Published)
        except msgspec.ValidationError as exc:
            raise StoreError(f"{state_key(node)}: not a node's state: {exc}") from exc

    def record_command(
        self, command: str, *, steps: int | None = None, level: str | None = None
    ) -> int:
        """Write a cycle-changing command under a new generation; return the generation."""
        generation = self.next_generation(COMMAND)
        value = JobCommand(command=command, steps=steps, level=level)
        self.put(f"{COMMAND}/{generation}", msgspec.to_builtins(value))
        return generation

    def latest_command(self) -> int:
        """The generation of the last command written (0: none yet); its value may still be
        on its way (the generation is taken before the value is written)."""
        return self.add(f"gen/{COMMAND}", 0)

    def command(self, generation: int, *, timeout_s: float) -> JobCommand | None:
        """The command of `generation` (waiting at most `timeout_s` for its value), or None
        for a value that is not a command."""
        value = self.get(f"{COMMAND}/{generation}", timeout_s=timeout_s)
        try:
            return msgspec.convert(value, JobCommand)
        except msgspec.ValidationError:
            return None


class AsyncJobStore:
    """The job store for the event loop: every call runs in a worker thread (TCPStore blocks),
    bounded by the store's own timeouts. `blocking` is the connection underneath.

    One call at a time: a TCPStore connection runs one operation at a time anyway (it locks
    each), so calls made together wait here, in the event loop, rather than each holding a
    worker thread blocked on that lock: the process's threads stay as many as its activities,
    not as many as its calls that happened to overlap."""

    def __init__(self, store: JobStore) -> None:
        self.blocking = store
        self._one_at_a_time = anyio.CapacityLimiter(1)

    async def _call(self, function: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(function, limiter=self._one_at_a_time)

    @classmethod
    async def host(cls) -> AsyncJobStore:
        return cls(await anyio.to_thread.run_sync(JobStore.host))

    @classmethod
    async def for_job(cls, cluster: ClusterSection, *, ready_s: float) -> AsyncJobStore:
        """One node: a store of its own on a free loopback port. Several: the leader (node 0)
        hosts it at `leader_addr:leader_port`; the others reach it within `ready_s`."""
        if cluster.nodes == 1:
            return await cls.host()
        address = cluster.leader_addr, cluster.leader_port
        if cluster.node_rank == 0:
            return cls(await anyio.to_thread.run_sync(JobStore.host, *address))
        connect = partial(JobStore.connect, *address, timeout_s=ready_s)
        return cls(await anyio.to_thread.run_sync(connect))

    @property
    def address(self) -> tuple[str, int]:
        return self.blocking.address

    async def another_connection(self, *, timeout_s: float = 30.0) -> JobStore:
        """A new connection to the same store (blocking waits on one connection queue); its
        calls wait at most `timeout_s`."""
        connect = partial(JobStore.connect, *self.address, timeout_s=timeout_s)
        return await anyio.to_thread.run_sync(connect)

    async def next_generation(self, name: str) -> int:
        return await self._call(partial(self.blocking.next_generation, name))

    async def put(self, key: str, value: object) -> None:
        await self._call(partial(self.blocking.put, key, value))

    async def publish(self, state: JobState, *, node: int) -> None:
        """Where node `node`'s part of the job stands, under `state_key(node)`: for every node
        and for operators (one key per node: with one for the job, the last writer won)."""
        record = Published(
            node=node,
            lifecycle=state.lifecycle.value,
            step=state.step,
            phases=[p.value for p in state.phases],
            reason=state.reason,
        )
        await self.put(state_key(node), msgspec.to_builtins(record))

    async def read_present(self, keys: list[str]) -> list[Json]:
        return await self._call(partial(self.blocking.read_present, keys))

    async def record_command(
        self, command: str, *, steps: int | None = None, level: str | None = None
    ) -> int:
        recording = partial(self.blocking.record_command, command, steps=steps, level=level)
        return await self._call(recording)

    async def latest_command(self) -> int:
        return await self._call(self.blocking.latest_command)

    async def command(self, generation: int, *, timeout_s: float) -> JobCommand | None:
        return await self._call(partial(self.blocking.command, generation, timeout_s=timeout_s))
