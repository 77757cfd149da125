"""The zygote: workers forked from it, gone with their driver or with it, and bad requests refused.

Real processes: a `timeshare run` killed with SIGKILL, a zygote killed under a running cycle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from tests.configs import FAST, config, toml_file
from tests.cycle.jobs import assert_nothing_left, processes_of, run, workers_of
from timeshare.cycle.factory import Exited, Forked, Refused, WorkerFactory
from timeshare.cycle.hooks import CycleHooks
from timeshare.cycle.workers import prepare_runtime
from timeshare.errors import CycleFailed, WorkerDied
from timeshare.state import JobState, Lifecycle

WAIT_S = 60.0


def wait_until(condition: object, timeout_s: float = WAIT_S) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.05)


def test_workers_are_forked_and_named_for_ps(runtime_dir: Path) -> None:
    cfg = toml_file(runtime_dir, FAST, job={"ranks": 2, "steps": 100_000})
    argv = [sys.executable, "-m", "timeshare", "run", str(cfg)]
    driver = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_dir = runtime_dir / "run"
        wait_until(lambda: len(workers_of(run_dir)) == 4)
        names = sorted(p.name() for p in workers_of(run_dir))
        assert names == ["ts-rollout-0", "ts-rollout-1", "ts-trainer-0", "ts-trainer-1"]
        [zygote] = [p for p in processes_of(run_dir) if p.name() == "ts-zygote"]
        assert zygote.ppid() == driver.pid
        assert all(p.ppid() == zygote.pid for p in workers_of(run_dir))
        assert all(os.getpgid(p.pid) == p.pid for p in workers_of(run_dir))  # own groups
        # SIGKILL the driver: its pipe to the zygote closes, and the zygote kills every worker
        # group it started, then exits. Nothing of the job is left running.
        driver.kill()
        driver.wait(timeout=10)
        wait_until(lambda: processes_of(run_dir) == [], timeout_s=10.0)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)
    prepare_runtime(runtime_dir / "run")  # what a restarted driver sweeps: staging, sockets
    assert_nothing_left(runtime_dir)


@pytest.mark.asyncio
async def test_a_killed_zygote_fails_the_cycle_at_once_naming_a_worker(runtime_dir: Path) -> None:
    cfg = config(runtime_dir, job={"ranks": 2, "steps": 100_000}, deadlines={"stall_s": 30.0})
    running = anyio.Event()

    def on_state(state: JobState) -> None:
        if state.lifecycle is Lifecycle.RUNNING:
            running.set()

    async def kill_the_zygote() -> None:
        await running.wait()
        [zygote] = [p for p in processes_of(runtime_dir) if p.name() == "ts-zygote"]
        os.kill(zygote.pid, signal.SIGKILL)

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        group.start_soon(kill_the_zygote)
        with pytest.raises(CycleFailed) as info:
            await run(cfg, hooks=CycleHooks(on_state=on_state))
    cause = info.value.cause
    assert isinstance(cause, WorkerDied) and cause.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 25.0  # the zygote's end, not the 30 s stall deadline
    assert_nothing_left(runtime_dir)


@pytest.mark.asyncio
async def test_a_bad_request_is_refused_and_the_zygote_goes_on(runtime_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOTIFY")}
    factory = await anyio.to_thread.run_sync(WorkerFactory.start, runtime_dir, env)
    replies: list[Forked | Exited | Refused] = []
    try:
        with anyio.fail_after(WAIT_S):
            await anyio.to_thread.run_sync(factory._send, b"not json\n")
            await anyio.to_thread.run_sync(factory._send, b'{"id": 1, "spec": "{}"}\n')
            async for reply in factory.replies():
                replies.append(reply)
                if len(replies) == 2:
                    break
        assert factory.process.poll() is None  # still serving
    finally:
        await anyio.to_thread.run_sync(factory.close)
    assert [type(r) for r in replies] == [Refused, Refused]
    assert all(isinstance(r, Refused) and "a bad request" in r.error for r in replies)
    assert factory.process.returncode == 0  # closing its requests ends it
