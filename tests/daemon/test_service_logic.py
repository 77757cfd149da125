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
from structlog.testing import capture_logs

from tests.configs import config
from tests.cycle.fake_workers import FakeWorkers, spawner
from tests.ports import free_port
from timeshare.config import load_config
from timeshare.daemon.metrics import Metrics
from timeshare.daemon.progress import SavedProgress
from timeshare.daemon.requests import OperatorRequests
from timeshare.daemon.service import IDLE_POLL_S, Service, ServiceParts, ServicePaths
from timeshare.daemon.systemd import Notifier
from timeshare.errors import NotRunning
from timeshare.protocols.control import WaitParams
from timeshare.protocols.store import AsyncJobStore
from timeshare.state.service import FINAL, ServiceLifecycle

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


@asynccontextmanager
async def idle_node(root: Path, node: int, port: int) -> AsyncIterator[OperatorRequests]:
    """Node `node` of a two-node job's daemon logic, idle (socket-activated), watching the
    job store for a `start` or `stop` given on the other node. `root` exists."""
    cfg = config(root, cluster={"nodes": 2, "node_rank": node, "leader_port": port})
    store = await AsyncJobStore.for_job(cfg.cluster, ready_s=30.0)
    spawn = spawner(FakeWorkers(cfg))
    parts = ServiceParts(Notifier(), Metrics(), store, activated=True, spawn=spawn)
    paths = ServicePaths(root / "job.toml", root, root / "control.sock")
    service = Service(load_config(None, environ={}), cfg, paths, parts, SavedProgress())
    await service.open()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(service.records.run)
            group.start_soon(service.watch_idle_nodes)
            yield OperatorRequests(service)
            group.cancel_scope.cancel()
    await service.records.close()


@pytest.mark.asyncio
async def test_the_leader_stays_until_an_idle_node_has_read_its_stop(tmp_path: Path) -> None:
    # The leader's daemon hosts the job store: had it exited as soon as `stop` was written, a
    # node that had not polled yet lost the store with the stop in it and idled on for good.
    port = free_port()
    async with idle_node(tmp_path, 0, port) as leader:
        follower_dir = tmp_path / "follower"
        follower_dir.mkdir()
        async with idle_node(follower_dir, 1, port) as follower:
            await anyio.sleep(3 * IDLE_POLL_S)  # the follower has read where commands stand
            await leader.stop("test")
            await leader.service.let_nodes_hear_stop()  # what the daemon does before it exits
            assert follower.service.state in FINAL  # read before the leader's store went
            assert leader.service.state in FINAL


@pytest.mark.asyncio
async def test_a_node_that_never_reads_the_stop_is_named_after_a_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("timeshare.daemon.service.STOP_HEARD_S", 1.0)
    async with idle_node(tmp_path, 0, free_port()) as leader:  # node 1 is down
        await leader.stop("test")
        with capture_logs() as logs, anyio.fail_after(10):
            await leader.service.let_nodes_hear_stop()
    unheard = [entry for entry in logs if entry["event"] == "service.stop.unheard"]
    assert [entry["nodes"] for entry in unheard] == [[1]]
