"""The service in-process, on fake workers and a real job store: how it answers and follows.

What needs the daemon's process (signals, sockets, systemd, the journal on disk after a crash)
is tested in test_service.py and test_systemd.py; this is the service's own logic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from tests.configs import config
from tests.cycle.fake_workers import FakeWorkers, spawner
from timeshare.config import load_config
from timeshare.daemon.metrics import Metrics
from timeshare.daemon.progress import SavedProgress
from timeshare.daemon.requests import OperatorRequests
from timeshare.daemon.service import Service, ServiceParts, ServicePaths
from timeshare.daemon.systemd import Notifier
from timeshare.errors import NotRunning
from timeshare.protocols.control import WaitParams
from timeshare.protocols.store import AsyncJobStore
from timeshare.state.service import ServiceLifecycle

S = ServiceLifecycle
WAIT = WaitParams(wait=True, timeout_s=30.0)


@asynccontextmanager
async def running_service(root: Path, *, activated: bool) -> AsyncIterator[OperatorRequests]:
    """A service of a long job on fake workers, its cycles running in the background."""
    cfg = config(root, job={"ranks": 2, "steps": 100_000})
    workers = FakeWorkers(cfg, delay_s={("rollout", 0): 0.002, ("rollout", 1): 0.002})
    parts = ServiceParts(
        Notifier(),
        Metrics(),
        await AsyncJobStore.host(),
        activated=activated,
        spawn=spawner(workers),
    )
    paths = ServicePaths(root / "job.toml", root, root / "control.sock")
    service = Service(load_config(None, environ={}), cfg, paths, parts, SavedProgress())
    await service.open()
    requests = OperatorRequests(service)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(service.records.run)
            group.start_soon(service.run_cycles)
            yield requests
            await requests.stop("test")
            await service.wait_stopping()
            group.cancel_scope.cancel()
    await service.records.close()


@pytest.mark.asyncio
async def test_a_pause_right_after_resume_reaches_the_new_cycle(tmp_path: Path) -> None:
    async with running_service(tmp_path, activated=True) as requests:
        service = requests.service
        assert service.state is S.IDLE
        assert (await requests.resume()).lifecycle == "starting"
        # At once, before the cycle has read a single command of the job store.
        paused = await requests.pause(WAIT)
        assert paused.lifecycle == "paused"
        assert (await requests.resume()).lifecycle in ("paused", "running")
        await requests.drain(WaitParams(wait=True, timeout_s=30.0))
        assert service.state is S.IDLE and service.reason == "drain requested"


@pytest.mark.asyncio
async def test_requests_in_idle_are_answered_by_the_table(tmp_path: Path) -> None:
    async with running_service(tmp_path, activated=True) as requests:
        with pytest.raises(NotRunning, match=r"pause: no cycle is running \(idle\)"):
            await requests.pause(WaitParams())
        assert (await requests.drain(WAIT)).lifecycle == "idle"  # nothing to drain: done
