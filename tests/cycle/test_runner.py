"""The cycle runner's logic against in-process fake workers (a real job store on loopback).

Every fault of the matrix (6 phases x {raise, hang, kill} x {trainer, rollout}) ends the run in
CycleFailed naming rank, role and phase, with the machine in FAILED blaming that worker; the
memory rules fail a pause or a BARRIER that holds memory. test_processes.py proves each fault
class once more with real worker processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.configs import config
from tests.cycle.fake_workers import FakeWorkers, samples_of, spawner
from tests.cycle.jobs import run
from timeshare.cycle.hooks import CycleHooks
from timeshare.errors import (
    CommandTimeout,
    CycleFailed,
    MemoryHeld,
    WorkerDied,
    WorkerError,
    WorkerStalled,
)
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.commands.params import PhaseParams
from timeshare.protocols.store import JobStore, state_key
from timeshare.state import MEMORY_FENCES, Blame, JobState, Lifecycle, Phase

CAUSES = {"raise": WorkerError, "kill": WorkerDied, "hang": WorkerStalled}
STALL_S = 0.05


class States:
    """Every state the machine told the hook about."""

    def __init__(self) -> None:
        self.seen: list[JobState] = []

    def __call__(self, state: JobState) -> None:
        self.seen.append(state)

    @property
    def last(self) -> JobState:
        return self.seen[-1]


@pytest.mark.asyncio
async def test_a_clean_run_goes_round_the_cycle_and_shuts_the_workers_down(tmp_path: Path) -> None:
    store = JobStore.host()
    workers = FakeWorkers(config(tmp_path, job={"ranks": 2, "steps": 2}))
    states = States()
    summary = await run(
        workers.config, store, spawn=spawner(workers), hooks=CycleHooks(on_state=states)
    )
    assert (summary.lifecycle, summary.step, summary.reason) == ("stopped", 2, "completed 2 steps")
    assert store.get(state_key(0), timeout_s=5.0) == {
        "node": 0,
        "lifecycle": "stopped",
        "step": 2,
        "phases": ["rollout", "rollout"],
        "reason": "completed 2 steps",
    }
    # Bootstrap enters at SYNC: two steps are 3 SYNCs and 2 TRAINs per rank.
    assert len(workers.commands("sync")) == 2 * 2 * 3
    assert len(summary.phase_seconds["train"]) == 2 * 2
    assert [r.phase for r in summary.reports[:4]] == [Phase.SYNC] * 2 + [Phase.BARRIER] * 2
    assert [s.lifecycle for s in states.seen][-2:] == [Lifecycle.DRAINING, Lifecycle.STOPPED]
    assert workers.shut_down_called
    # Each trainer's TRAIN got its own rank's samples of the ROLLOUT before it, as they came.
    trains = [c for c in workers.commands("train") if c.worker.role == "trainer"]
    assert len(trains) == 4
    for train in trains:
        assert isinstance(train.params, PhaseParams)
        rank, step = train.worker.rank, train.params.step or 0
        assert bytes(train.params.batch) == bytes(samples_of(rank, step - 1))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["raise", "hang", "kill"])
@pytest.mark.parametrize("role", ["trainer", "rollout"])
@pytest.mark.parametrize("phase", [p.value for p in Phase])
async def test_fault_matrix(tmp_path: Path, phase: str, role: str, kind: str) -> None:
    faults = [{"role": role, "rank": 1, "phase": phase, "kind": kind}]
    cfg = config(
        tmp_path, job={"ranks": 2, "steps": 2}, faults=faults, deadlines={"stall_s": STALL_S}
    )
    workers = FakeWorkers(cfg)
    states = States()
    with pytest.raises(CycleFailed) as info:
        await run(cfg, spawn=spawner(workers), hooks=CycleHooks(on_state=states))
    failed = info.value
    assert (failed.rank, failed.role, failed.phase) == (1, role, phase)
    assert f"{role} rank 1 failed in phase {phase}" in str(failed)
    assert isinstance(failed.cause, CAUSES[kind])
    if kind == "raise":
        assert (
            isinstance(failed.cause, WorkerError) and failed.cause.remote_type == "SimulatedFault"
        )
    assert failed.after_s is not None and failed.after_s < STALL_S + 2.0
    # The machine learned it: FAILED, blaming that worker, the reason in words.
    assert states.last.lifecycle is Lifecycle.FAILED
    assert states.last.blame == Blame(1, role, phase)
    assert states.last.reason == str(failed)
    assert not workers.shut_down_called


@pytest.mark.asyncio
async def test_a_command_past_its_deadline_fails_the_run(tmp_path: Path) -> None:
    faults = [{"role": "rollout", "rank": 0, "phase": "resume", "kind": "hang"}]
    cfg = config(tmp_path, faults=faults, deadlines={"stall_s": 5.0, "commands": {"resume": 0.1}})
    with pytest.raises(CycleFailed) as info:
        await run(cfg, spawn=spawner(FakeWorkers(cfg)))
    assert isinstance(info.value.cause, CommandTimeout)
    assert (info.value.role, info.value.phase) == ("rollout", "resume")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("held", "blamed"),
    [({("rollout", 1): 512.0}, Blame(1, "rollout", "pause")), ({}, None)],
    ids=["held", "released"],
)
async def test_a_pause_that_released_nothing_is_a_failure(
    tmp_path: Path, held: dict[tuple[str, int], float], blamed: Blame | None
) -> None:
    store = JobStore.host()
    operator = JobStore.connect(*store.address)
    operator.record_command("pause")  # written before the run: it applies at the first boundary
    cfg = config(tmp_path, job={"ranks": 2, "steps": 3})
    workers = FakeWorkers(cfg, held_mb=held)
    states = States()

    def drain_once_paused(state: JobState) -> None:
        states(state)
        if state.lifecycle is Lifecycle.PAUSED:
            operator.record_command("drain")

    hooks = CycleHooks(on_state=drain_once_paused, commands_from=0)
    if blamed is None:
        summary = await run(cfg, store, spawn=spawner(workers), hooks=hooks)
        assert summary.reason == "drain requested while paused"
        assert Lifecycle.PAUSED in [s.lifecycle for s in states.seen]
    else:
        with pytest.raises(CycleFailed) as info:
            await run(cfg, store, spawn=spawner(workers), hooks=hooks)
        failed = info.value
        assert (failed.rank, failed.role, failed.phase) == (1, "rollout", "pause")
        assert isinstance(failed.cause, MemoryHeld) and "still held" in str(failed)
        assert "rollout rank 1: 512" in str(failed)
        assert states.last.blame == blamed
        assert Lifecycle.PAUSED not in [s.lifecycle for s in states.seen]  # never paused
    asked = {c.worker for c in workers.commands("held")}
    assert asked == {WorkerId(role, rank) for rank in (0, 1) for role in ("trainer", "rollout")}


@pytest.mark.asyncio
async def test_a_trainer_holding_memory_at_barrier_fails_the_run(tmp_path: Path) -> None:
    cfg = config(tmp_path, job={"ranks": 2})
    workers = FakeWorkers(cfg, held_mb={("trainer", 1): 64.0})
    with pytest.raises(CycleFailed) as info:
        await run(cfg, spawn=spawner(workers))
    failed = info.value
    assert (failed.rank, failed.role, failed.phase) == (1, "trainer", "barrier")
    assert isinstance(failed.cause, MemoryHeld)
    assert "trainer still holds 64 MiB of device memory at BARRIER" in str(failed)


@pytest.mark.asyncio
@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
async def test_ranks_meet_at_the_store_barrier_only_while_resume_is_fenced(
    tmp_path: Path, fenced: bool
) -> None:
    # Rank 1's BARRIER ends later than rank 0 may wait for it at the store barrier.
    cfg = config(tmp_path, job={"ranks": 2, "steps": 1}, deadlines={"barrier_s": 0.2})
    workers = FakeWorkers(cfg, delay_s={("barrier", 1): 0.5})
    fences = MEMORY_FENCES if fenced else MEMORY_FENCES - {Phase.RESUME}
    if not fenced:
        assert (await run(cfg, spawn=spawner(workers), fences=fences)).lifecycle == "stopped"
        return
    with pytest.raises(CycleFailed) as info:
        await run(cfg, spawn=spawner(workers), fences=fences)
    assert (info.value.rank, info.value.role, info.value.phase) == (0, "trainer", "barrier")
    assert "ranks [1] did not arrive" in str(info.value.cause)


@pytest.mark.asyncio
async def test_a_second_cycle_on_the_same_store_waits_at_its_own_barriers(tmp_path: Path) -> None:
    """Barrier keys an earlier cycle left must not let a later one's ranks pass unmet."""
    store = JobStore.host()
    first = FakeWorkers(config(tmp_path, job={"ranks": 2, "steps": 1}))
    await run(first.config, store, spawn=spawner(first))  # its last BARRIER: generation 2
    # The second cycle's second BARRIER (step 2) is late on rank 1: rank 0 must wait for it.
    cfg = config(tmp_path, job={"ranks": 2, "steps": 2}, deadlines={"barrier_s": 0.3})
    second = FakeWorkers(cfg, start_step=1, delay_s={("barrier", 1): 1.0}, from_step=2)
    with pytest.raises(CycleFailed) as info:
        await run(cfg, store, spawn=spawner(second))
    assert (info.value.rank, info.value.phase) == (0, "barrier")  # rank 0 timed out waiting
    assert "ranks [1] did not arrive" in str(info.value.cause)
