"""Cycle-changing commands go through the job store and take effect at safe points."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon.jobs import assert_nothing_left, config, run
from timeshare.daemon.driver import RunSummary
from timeshare.protocols.store import JobStore


async def wait_for_state(
    store: JobStore, lifecycle: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    with anyio.fail_after(timeout_s):
        while True:
            if store.has("state"):
                state: dict[str, Any] = await anyio.to_thread.run_sync(
                    lambda: store.get("state", timeout_s=1.0)
                )
                if state["lifecycle"] == lifecycle:
                    return state
            await anyio.sleep(0.05)


@asynccontextmanager
async def running_job(
    runtime_dir: Path, **job: int
) -> AsyncIterator[tuple[JobStore, JobStore, list[RunSummary]]]:
    """A long job running in the background: its store, an operator's connection, its summary."""
    store = JobStore.host()
    operator = JobStore.connect(*store.address)
    result: list[RunSummary] = []

    async def job_task() -> None:
        result.append(await run(config(runtime_dir, job={"steps": 10_000, **job}), store))

    async with anyio.create_task_group() as group:
        group.start_soon(job_task)
        await wait_for_state(store, "running")
        yield store, operator, result


@pytest.mark.slow
@pytest.mark.asyncio
async def test_pause_resume_and_drain_through_the_store(runtime_dir: Path) -> None:
    async with running_job(runtime_dir, ranks=2) as (store, operator, result):
        operator.record_command("pause")
        operator.record_command("pause")  # repeating a command is harmless
        paused = await wait_for_state(store, "paused")
        assert paused["phases"] == ["rollout", "rollout"]  # the cycle boundary: all released
        await anyio.sleep(0.5)
        assert store.get("state", timeout_s=1.0) == paused  # nothing moves while paused
        operator.record_command("bogus")  # logged and skipped, the job goes on
        operator.record_command("resume")
        await wait_for_state(store, "running")
        operator.record_command("drain")
    [summary] = result
    assert (summary.lifecycle, summary.reason) == ("stopped", "drain requested")
    assert paused["step"] < summary.step < 10_000
    assert_nothing_left(runtime_dir)


@pytest.mark.asyncio
async def test_stop_ends_the_run_at_once(runtime_dir: Path) -> None:
    async with running_job(runtime_dir) as (_, operator, result):
        operator.record_command("stop")
    [summary] = result
    assert (summary.lifecycle, summary.reason) == ("stopped", "stop requested")
    assert summary.step < 10_000
    assert_nothing_left(runtime_dir)
