"""An in-process fake of the job's workers: the cycle's logic, driven in milliseconds.

It answers every command with the typed result a real worker gives, fires the config's injected
faults as the real workers do (as a phase starts: `raise` is a WorkerError from the remote
SimulatedFault, `kill` a WorkerDied, `hang` a WorkerStalled once the stall deadline passed, or a
CommandTimeout if the command's deadline comes first), and can be told what memory a worker
still holds. It records every call, so a test can ask what the cycle did.

This is the layer below the cycle, faked: the real processes are proven by the end-to-end tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec

from timeshare.config import Config
from timeshare.cycle.workers import Workers, WorkerSpawner
from timeshare.errors import CommandTimeout, WorkerDied, WorkerError, WorkerStalled
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.commands.params import LogLevelParams, PhaseParams
from timeshare.protocols.commands.results import (
    BootstrapResult,
    CommandResult,
    HeldResult,
    RolloutResult,
    SyncResult,
    TrainFigures,
    TrainResult,
)
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import TransferReport

R = TypeVar("R")


def samples_of(rank: int, step: int) -> msgspec.Raw:
    """What the fake rollout of `rank` samples at `step` (opaque to the cycle, as real ones)."""
    return msgspec.Raw(msgspec.msgpack.encode([f"rank {rank} step {step}"]))


@dataclass(frozen=True)
class Call:
    worker: WorkerId
    command: str
    params: object


@dataclass
class FakeWorkers(Workers):
    config: Config
    start_step: int = 0  # the step the checkpoint holds
    held_mb: dict[tuple[str, int], float] = field(default_factory=dict)  # (role, rank) -> MiB
    delay_s: dict[tuple[str, int], float] = field(default_factory=dict)  # (command, rank) -> s
    from_step: int = 0  # delays apply from this step on
    calls: list[Call] = field(default_factory=list)
    controls: list[Call] = field(default_factory=list)
    shut_down_called: bool = False

    async def wait_ready(self, *, timeout_s: float) -> None:
        assert timeout_s > 0

    async def call(
        self,
        worker: WorkerId,
        command: str,
        params: PhaseParams | None = None,
        *,
        deadline_s: float,
        returns: type[R],
    ) -> R:
        params = params or PhaseParams()
        self.calls.append(Call(worker, command, params))
        await self._fire_faults(worker, command, params.step, deadline_s)
        if (params.step or 0) >= self.from_step:
            await anyio.sleep(self.delay_s.get((command, worker.rank), 0.0))
        result = self._result(worker, command, params)
        assert isinstance(result, returns), (worker, command, result, returns)
        return result

    async def control(
        self,
        worker: WorkerId,
        command: str,
        params: LogLevelParams | None = None,
        *,
        timeout_s: float,
        returns: type[R],
    ) -> R:
        self.controls.append(Call(worker, command, params))
        assert isinstance(command, returns)
        return command

    async def shut_down(self, *, deadline_s: float) -> None:
        self.shut_down_called = True

    def commands(self, name: str) -> list[Call]:
        return [call for call in self.calls if call.command == name]

    async def _fire_faults(
        self, worker: WorkerId, command: str, step: int | None, deadline_s: float
    ) -> None:
        for fault in self.config.faults:
            if (fault.role, fault.rank, fault.phase) != (worker.role, worker.rank, command):
                continue
            if fault.step is not None and fault.step != step:
                continue
            rank, role = worker.rank, worker.role
            if fault.kind == "raise":
                message = f"injected fault in {command}"
                raise WorkerError(
                    f"{worker} failed in {command}: SimulatedFault: {message}",
                    rank=rank,
                    role=role,
                    command=command,
                    remote_type="SimulatedFault",
                    remote_message=message,
                )
            if fault.kind == "kill":
                message = f"{worker} exited during {command}"
                raise WorkerDied(message, rank=rank, role=role, command=command, returncode=-9)
            stall_s = self.config.deadlines.stall_s
            await anyio.sleep(min(stall_s, deadline_s))
            if deadline_s < stall_s:
                message = f"{worker} did not finish {command}"
                raise CommandTimeout(message, rank=rank, role=role, command=command)
            message = f"{worker} made no progress in {command}"
            raise WorkerStalled(message, rank=rank, role=role, command=command)

    def _result(self, worker: WorkerId, command: str, params: PhaseParams) -> object:
        step = params.step or 0
        held = self.held_mb.get((worker.role, worker.rank), 0.0)
        trainer = worker.role == "trainer"
        if command == "held" or (command == "barrier" and trainer):
            return HeldResult(held_mb=held)
        if command == "sync":
            digest = f"weights of version {step}"
            transfer = TransferReport(version=step, bytes=4096, tensors=4, buckets=1, seconds=0.001)
            return SyncResult(transfer=transfer, digest=digest)
        if command == "bootstrap" and trainer:
            return BootstrapResult(step=self.start_step)
        if command == "train" and trainer:
            figures = TrainFigures(step=step, samples=0, committed=step, reward_mean=0.5)
            return TrainResult(figures=figures)
        if command == "rollout" and not trainer:
            samples = samples_of(worker.rank, step)
            return RolloutResult(samples=samples, version=step, reward_mean=0.5)
        return CommandResult()


def spawner(workers: FakeWorkers) -> WorkerSpawner:
    """A spawner that hands `workers` to the cycle (whatever config and store it is given)."""

    @asynccontextmanager
    async def spawn(config: Config, store: JobStore) -> AsyncIterator[Workers]:
        yield workers

    return spawn
