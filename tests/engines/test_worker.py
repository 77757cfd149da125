"""The worker process itself: abort on the control lane interrupts a hanging generate, and a
trainer's SYNC, whose sender runs an event loop on the worker's main thread."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.conftest import socket_files
from timeshare.engines.faults import Fault
from timeshare.engines.worker import Role, WorkerSpec
from timeshare.errors import WorkerError
from timeshare.protocols.commands import WorkerId, WorkerLanes, watch_process
from timeshare.protocols.commands.params import PhaseParams
from timeshare.protocols.commands.results import (
    BootstrapResult,
    HeldResult,
    RolloutResult,
    SyncResult,
    WorkerStatus,
)
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import TransferConfig

ROLLOUT = WorkerId("rollout", 0)
TRAINER = WorkerId("trainer", 0)


async def wait_busy(
    lanes: WorkerLanes, command: str, timeout_s: float = 30.0, worker: WorkerId = ROLLOUT
) -> None:
    """Until the worker says, on its control lane, that it runs `command`."""
    with anyio.fail_after(timeout_s):
        for _ in range(int(timeout_s / 0.05)):
            status = await lanes.control(worker, "status", timeout_s=5.0, returns=WorkerStatus)
            if status.busy == command:
                return
            await anyio.sleep(0.05)


def spec_of(
    lanes: WorkerLanes, runtime_dir: Path, store: JobStore, role: Role, **settings: Any
) -> WorkerSpec:
    """A worker of rank 0 of 1 on `lanes`, reaching `store` (the caller keeps it alive)."""
    host, port = store.address
    return WorkerSpec(
        role=role,
        rank=0,
        world_size=1,
        work_endpoint=lanes.work_endpoint,
        control_endpoint=lanes.control_endpoint,
        weight_endpoint=f"ipc://{runtime_dir}/w-rank0.sock",
        store_host=host,
        store_port=port,
        checkpoint_dir=str(runtime_dir / "ckpt"),
        **settings,
    )


@asynccontextmanager
async def running(lanes: WorkerLanes, spec: WorkerSpec) -> AsyncIterator[subprocess.Popen[bytes]]:
    """The worker of `spec` in a process of its own, watched and ready; it must exit 0 (asked to
    shut down) by the end, else it is killed; no socket file is left either way."""
    worker = WorkerId(spec.role, spec.rank)
    argv = [sys.executable, "-m", "timeshare.engines.worker", msgspec.json.encode(spec).decode()]
    process = await anyio.to_thread.run_sync(lambda: subprocess.Popen(argv))
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(watch_process, lanes, worker, process)
            await lanes.wait_ready([worker], timeout_s=60.0)
            yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
    assert process.returncode == 0


@pytest.mark.asyncio
async def test_abort_interrupts_a_hanging_generate_within_a_second(runtime_dir: Path) -> None:
    store = JobStore.host()
    async with WorkerLanes.open(runtime_dir, stall_timeout_s=60.0) as lanes:
        hang = [Fault("rollout", 0, "rollout", "hang")]
        transfer = TransferConfig(bucket_mb=1.0)
        spec = spec_of(lanes, runtime_dir, store, "rollout", transfer=transfer, faults=hang)
        outcome: dict[str, Any] = {}

        async def generate() -> None:
            try:
                await lanes.call(ROLLOUT, "rollout", deadline_s=60.0, returns=RolloutResult)
            except WorkerError as exc:
                outcome["error"], outcome["at"] = exc, time.monotonic()

        async with running(lanes, spec):
            async with anyio.create_task_group() as calls:
                calls.start_soon(generate)
                await wait_busy(lanes, "rollout")
                asked = time.monotonic()
                assert (
                    await lanes.control(ROLLOUT, "abort", timeout_s=5.0, returns=object)
                    == "rollout"
                )
            assert outcome["error"].remote_type == "Aborted"
            assert outcome["at"] - asked < 1.0
            await lanes.call(ROLLOUT, "shutdown", deadline_s=10.0, returns=type(None))
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_abort_ends_a_trainers_sync_and_its_sender_frees_staging(runtime_dir: Path) -> None:
    """The sender waits for a receiver that never joins (its staging already made): the abort
    cancels the send on the main thread's loop, the call fails as Aborted, and the worker still
    answers and shuts down cleanly, leaving no segment (the leak check) and no socket file."""
    store = JobStore.host()
    async with WorkerLanes.open(runtime_dir, stall_timeout_s=60.0) as lanes:
        transfer = TransferConfig(bucket_mb=1.0, handshake_timeout_s=60.0)
        spec = spec_of(lanes, runtime_dir, store, "trainer", transfer=transfer)
        outcome: dict[str, Any] = {}

        async def sync() -> None:
            try:
                await lanes.call(TRAINER, "sync", deadline_s=60.0, returns=SyncResult)
            except WorkerError as exc:
                outcome["error"], outcome["at"] = exc, time.monotonic()

        async with running(lanes, spec):
            await lanes.call(TRAINER, "bootstrap", deadline_s=60.0, returns=BootstrapResult)
            async with anyio.create_task_group() as calls:
                calls.start_soon(sync)
                await wait_busy(lanes, "sync", worker=TRAINER)
                await anyio.sleep(0.3)  # into the handshake's wait
                asked = time.monotonic()
                assert (
                    await lanes.control(TRAINER, "abort", timeout_s=5.0, returns=object) == "sync"
                )
            assert outcome["error"].remote_type == "Aborted"
            assert "sync aborted" in str(outcome["error"])
            assert outcome["at"] - asked < 2.0
            status = await lanes.control(TRAINER, "status", timeout_s=5.0, returns=WorkerStatus)
            assert status.busy is None
            await lanes.call(TRAINER, "shutdown", deadline_s=10.0, returns=type(None))
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_params_of_the_wrong_shape_fail_the_call_by_name_and_the_worker_serves_on(
    runtime_dir: Path,
) -> None:
    """A phase's params are a typed Struct (protocols/commands/params.py): a field of the wrong
    type or one the worker does not know fails that call naming what was wrong; so does an
    unknown log level. The next good call is answered."""
    store = JobStore.host()
    async with WorkerLanes.open(runtime_dir, stall_timeout_s=60.0) as lanes:
        spec = spec_of(lanes, runtime_dir, store, "rollout", transfer=TransferConfig())
        async with running(lanes, spec):
            bad = {
                "held": (
                    {"step": "three"},
                    "bad params for held: Expected `int | null`, got `str` - at `$.step`",
                ),
                "barrier": (
                    {"stpe": 3},
                    "bad params for barrier: Object contains unknown field `stpe`",
                ),
            }
            for command, (params, said) in bad.items():
                with pytest.raises(WorkerError) as failed:
                    await lanes.call(ROLLOUT, command, params, deadline_s=30.0, returns=object)
                assert failed.value.remote_type == "ProtocolError"
                assert said in str(failed.value)
            with pytest.raises(WorkerError, match="no log level 'loud'"):
                await lanes.control(
                    ROLLOUT, "log_level", {"level": "loud"}, timeout_s=5.0, returns=str
                )
            assert (
                await lanes.control(
                    ROLLOUT, "log_level", {"level": "debug"}, timeout_s=5.0, returns=str
                )
                == "debug"
            )
            held = await lanes.call(
                ROLLOUT, "held", PhaseParams(), deadline_s=30.0, returns=HeldResult
            )
            assert held.held_mb == 0.0
            await lanes.call(ROLLOUT, "shutdown", deadline_s=10.0, returns=type(None))
    assert socket_files(runtime_dir) == []
