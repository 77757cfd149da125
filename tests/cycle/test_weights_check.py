"""The weights check as the cycle performs it, against in-process fake workers: a rollout that
does not hold its trainer's weights after SYNC ends the run naming it (`[checks]
on_weights_mismatch = "fail"`, the default), before any sample is drawn from those weights, or
is a figure and a warning every step (`"warn"`). test_processes.py shows it with real workers
whose rollout really holds other weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from tests.configs import config
from tests.cycle.fake_workers import FakeWorkers, spawner
from tests.cycle.jobs import run
from timeshare.config import Config
from timeshare.cycle.hooks import BootstrapReport, CycleHooks, PhaseReport
from timeshare.cycle.steps import StepFigures, StepLog
from timeshare.errors import CycleFailed, WeightsMismatch
from timeshare.protocols.commands import WorkerId
from timeshare.protocols.commands.params import PhaseParams
from timeshare.protocols.commands.results import SyncResult, TablesResult, WorkerLoad
from timeshare.state import Blame, JobState, Lifecycle

FIRST_BAD = 2  # the weight version from which the odd rollout holds other weights


# The trainer's per-tensor lines of every version, and the rollout's where it holds other weights.
SENT = {"embed.weight": "torch.float32|(16, 8)|aa", "lm_head.weight": "torch.float32|(16, 8)|bb"}
HELD = {**SENT, "lm_head.weight": "torch.float32|(16, 8)|cc"}


@dataclass
class OtherWeights(FakeWorkers):
    """Fake workers of two ranks whose rollout engines each have `tp` TP workers; from
    version FIRST_BAD on, rank 1's rollout holds other weights (`engine`: its engine's digest
    differs; `worker`: that TP worker's does; `missing`: that TP worker sends no report), its
    lm_head's bytes differing in the per-tensor lines it answers `tables` with (of the version
    it synced last, or of `tables_version`)."""

    tp: int = 1
    engine: bool = False
    worker: int | None = None
    missing: int | None = None
    tables_version: int | None = None
    synced: dict[WorkerId, int] = field(default_factory=dict)

    def _result(self, worker: WorkerId, command: str, params: PhaseParams) -> object:
        if command == "tables":
            return self._tables(worker)
        result = super()._result(worker, command, params)
        if command != "sync" or not isinstance(result, SyncResult):
            return result
        self.synced[worker] = params.step or 0
        if worker.role == "trainer":
            return msgspec.structs.replace(result, receivers=self.tp)
        bad = worker.rank == 1 and (params.step or 0) >= FIRST_BAD
        loads = [
            WorkerLoad(k, 4096, "other" if bad and k == self.worker else result.digest)
            for k in range(self.tp)
            if not (bad and k == self.missing)
        ]
        digest = "other" if bad and self.engine else result.digest
        return msgspec.structs.replace(result, digest=digest, workers=loads if self.tp > 1 else [])

    def _tables(self, worker: WorkerId) -> TablesResult:
        version = self.synced[worker] if self.tables_version is None else self.tables_version
        if worker.role == "trainer":
            return TablesResult(version=version, tensors=SENT)
        bad = worker.rank == 1 and version >= FIRST_BAD
        engine = HELD if bad and self.engine else SENT
        workers = {k: HELD if bad and k == self.worker else SENT for k in range(self.tp)}
        return TablesResult(version=version, tensors=engine, workers=workers)


def job(tmp_path: Path, **checks: Any) -> Config:
    return config(tmp_path, job={"ranks": 2, "steps": 3}, checks=checks)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("odd", "named"),
    [
        ({"engine": True}, "rollout rank 1: the engine holds other, not the weights of version 2"),
        ({"tp": 2, "worker": 1}, "TP worker 1 of 2 holds other, not the weights of version 2"),
        ({"tp": 2, "missing": 0}, "TP worker 0 of 2 sent no report of what it loaded"),
    ],
    ids=["engine", "tp-worker", "tp-worker-silent"],
)
async def test_a_rollout_not_holding_its_trainers_weights_ends_the_run_naming_it(
    tmp_path: Path, odd: dict[str, Any], named: str
) -> None:
    tensor = (
        "which tensor differs is not known: the rollout side reported nothing for it"
        if "missing" in odd
        else "the first tensor that differs: lm_head.weight (torch.float32, shape (16, 8)): "
        "its bytes differ"
    )
    workers = OtherWeights(job(tmp_path), **odd)  # on_weights_mismatch: the default, "fail"
    states: list[JobState] = []
    with pytest.raises(CycleFailed) as info:
        await run(workers.config, spawn=spawner(workers), hooks=CycleHooks(on_state=states.append))
    failed = info.value
    assert (failed.rank, failed.role, failed.phase) == (1, "rollout", "sync")
    assert isinstance(failed.cause, WeightsMismatch)
    assert (failed.cause.rank, failed.cause.worker) == (1, odd.get("worker", odd.get("missing")))
    assert str(failed).startswith("rollout rank 1 failed in phase sync: WeightsMismatch: ")
    assert named in str(failed)
    assert str(failed).endswith(tensor)
    assert states[-1].lifecycle is Lifecycle.FAILED
    assert states[-1].blame == Blame(1, "rollout", "sync")
    # Step 2's TRAIN was committed before its SYNC; nothing was drawn from the other weights.
    trained = [c.params for c in workers.commands("train") if c.worker.role == "trainer"]
    assert sorted(p.step or 0 for p in trained if isinstance(p, PhaseParams)) == [1, 1, 2, 2]
    assert all(
        isinstance(c.params, PhaseParams) and (c.params.step or 0) < FIRST_BAD
        for c in workers.commands("rollout") + workers.commands("resume")
    )


@pytest.mark.asyncio
async def test_under_warn_the_run_goes_on_with_the_figure_false_and_a_warning_each_step(
    tmp_path: Path,
) -> None:
    workers = OtherWeights(job(tmp_path, on_weights_mismatch="warn"), tp=2, worker=1)
    steps = StepLog(2)
    figures: list[StepFigures] = []

    async def observe(report: PhaseReport | BootstrapReport) -> None:
        if isinstance(report, PhaseReport) and (done := steps.add(report)) is not None:
            figures.append(done)

    with capture_logs() as logs:
        summary = await run(workers.config, spawn=spawner(workers), hooks=CycleHooks(observe))
    assert (summary.lifecycle, summary.step) == ("stopped", 3)
    assert [(f.step, f.weights_match) for f in figures] == [(1, True), (2, False), (3, False)]
    warned = [e for e in logs if e["event"] == "cycle.weights.mismatch"]
    assert [(e["log_level"], e["step"], e["rank"], e["worker"]) for e in warned] == [
        ("warning", 2, 1, 1),
        ("warning", 3, 1, 1),
    ]
    assert "TP worker 1 of 2 holds other" in warned[0]["error"]
    assert warned[0]["error"].endswith(
        "lm_head.weight (torch.float32, shape (16, 8)): its bytes differ"
    )


@pytest.mark.asyncio
async def test_lines_of_another_version_leave_the_tensor_unknown_and_the_run_still_ends(
    tmp_path: Path,
) -> None:
    workers = OtherWeights(job(tmp_path), engine=True, tables_version=1)
    with pytest.raises(CycleFailed) as info:
        await run(workers.config, spawn=spawner(workers))
    assert isinstance(info.value.cause, WeightsMismatch)
    assert str(info.value).endswith(
        "which tensor differs is not known: the per-tensor lines could not be had: trainer 1 "
        "answered with the lines of version 1, not 2's"
    )
