"""Cycle-changing commands go through the job store and take effect at safe points.

A real job store on loopback, the runner, and in-process fake workers: what is tested is how the
runner reads commands and applies them, not the workers (the service tests do it end to end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from tests.configs import config
from tests.cycle.fake_workers import FakeWorkers, spawner
from tests.cycle.jobs import run
from timeshare.cycle import runner
from timeshare.cycle.hooks import CycleHooks, RunSummary
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.commands.params import LogLevelParams
from timeshare.protocols.store import JobStore, state_key
from timeshare.state import JobState, Lifecycle

WAIT_S = 30.0
POLL_S = 0.01


@dataclass
class Job:
    """A long job running in the background: its store, an operator's connection, its states."""

    store: JobStore
    operator: JobStore
    workers: FakeWorkers
    states: list[JobState] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)
    result: list[RunSummary] = field(default_factory=list)

    def on_state(self, state: JobState) -> None:
        self.states.append(state)
        self.changed.set()
        self.changed = anyio.Event()

    async def published(self, lifecycle: str) -> None:
        """Until the job store says `lifecycle` (the runner writes it right after telling)."""
        with anyio.fail_after(WAIT_S):
            for _ in range(int(WAIT_S / POLL_S)):
                if self.store.published(0, timeout_s=WAIT_S).lifecycle == lifecycle:
                    return
                await anyio.sleep(POLL_S)
        raise AssertionError(f"the store never said {lifecycle}")

    async def wait_for(self, condition: Callable[[JobState], bool]) -> JobState:
        with anyio.fail_after(WAIT_S):
            while not (self.states and condition(self.states[-1])):
                await self.changed.wait()
        return self.states[-1]


@asynccontextmanager
async def running_job(root: Path, ranks: int = 2) -> AsyncIterator[Job]:
    store = JobStore.host()
    cfg = config(root, job={"ranks": ranks, "steps": 10_000})
    job = Job(store, JobStore.connect(*store.address), FakeWorkers(cfg, delay_s=_slow(ranks)))

    async def job_task() -> None:
        hooks = CycleHooks(on_state=job.on_state, keep_reports=False)
        job.result.append(await run(cfg, store, spawn=spawner(job.workers), hooks=hooks))

    async with anyio.create_task_group() as group:
        group.start_soon(job_task)
        await job.wait_for(lambda s: s.lifecycle is Lifecycle.RUNNING)
        yield job


def _slow(ranks: int) -> dict[tuple[str, int], float]:
    """Rollouts that take a moment, as real ones do: the job is seen in every phase."""
    return {("rollout", rank): 0.005 for rank in range(ranks)}


@pytest.mark.asyncio
async def test_pause_resume_and_drain_through_the_store(tmp_path: Path) -> None:
    async with running_job(tmp_path) as job:
        job.operator.record_command("pause")
        job.operator.record_command("pause")  # repeating a command is harmless
        paused = await job.wait_for(lambda s: s.lifecycle is Lifecycle.PAUSED)
        assert [p.value for p in paused.phases] == ["rollout", "rollout"]  # the cycle boundary
        await job.published("paused")  # for every node and operator to see
        calls = len(job.workers.calls)
        # Nothing moves while paused, proven by events the runner handled after the pause: a
        # bogus command (logged and skipped), then a new step limit (a transition, told).
        job.operator.record_command("bogus")
        job.operator.record_command("steps", steps=9_999)
        later = await job.wait_for(lambda s: s.max_steps == 9_999)
        assert later.lifecycle is Lifecycle.PAUSED and later.step == paused.step
        assert len(job.workers.calls) == calls
        job.operator.record_command("resume")
        await job.wait_for(lambda s: s.step > paused.step)
        job.operator.record_command("drain")
    [summary] = job.result
    assert (summary.lifecycle, summary.reason) == ("stopped", "drain requested")
    assert paused.step < summary.step < 10_000


@pytest.mark.asyncio
async def test_a_new_lifecycle_is_published_at_once_whatever_the_pace_of_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps and phases are written at most every PUBLISH_EVERY_S (several nodes: at the beat's
    pace); a pause is what an operator waits for, and it is written as it happens."""
    monkeypatch.setattr(runner, "PUBLISH_EVERY_S", 3600.0)
    async with running_job(tmp_path) as job:
        for _ in range(int(WAIT_S / POLL_S)):  # the first write (running): a blocking get
            if job.store.has(state_key(0)):  # would hold up the loop that makes it
                break
            await anyio.sleep(POLL_S)
        job.operator.record_command("pause")
        await job.wait_for(lambda s: s.lifecycle is Lifecycle.PAUSED)
        with anyio.fail_after(10.0):  # not an hour
            await job.published("paused")
        job.operator.record_command("stop")


@pytest.mark.asyncio
async def test_stop_ends_the_run_at_once(tmp_path: Path) -> None:
    async with running_job(tmp_path, ranks=1) as job:
        job.operator.record_command("stop")
    [summary] = job.result
    assert (summary.lifecycle, summary.reason) == ("stopped", "stop requested")
    assert summary.step < 10_000


@pytest.mark.asyncio
async def test_a_log_level_reaches_every_worker_on_its_control_lane(tmp_path: Path) -> None:
    async with running_job(tmp_path) as job:
        job.operator.record_command("log_level", level="debug")
        job.operator.record_command("steps", steps=9_998)  # read after the log level
        await job.wait_for(lambda s: s.max_steps == 9_998)
        job.operator.record_command("stop")
    levels = [(c.worker, c.params) for c in job.workers.controls if c.command == "log_level"]
    workers = [WorkerId(role, rank) for rank in (0, 1) for role in ("trainer", "rollout")]
    assert levels == [(worker, LogLevelParams("debug")) for worker in workers]
