"""Every config key reaches the code that uses it: set to a non-default value, seen where it acts.

The [transfer], [engine.simulated] and [[faults]] sections reach each worker whole. In real runs:
[job] and [deadlines] keys act in the driver; the transfer's bucket size, pipeline depth,
checksum and its handshake / ack / begin timeouts act in the workers' weight channel; the
simulated engine's tensor count and size shape what moves; faults fire where and when they say
(the fault matrix and the fence tests cover kinds, roles, phases, sizes and engine_span).
finalize_timeout_s, linger_s and transport act inside the channel and are observed by its tests.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.configs import config
from tests.cycle.jobs import assert_nothing_left, run
from timeshare.config import Config
from timeshare.cycle.workers import worker_spec
from timeshare.errors import (
    AckTimeout,
    CollectiveTimeout,
    CommandTimeout,
    CycleFailed,
    WorkerError,
    WorkersNotReady,
    WorkerStalled,
)
from timeshare.protocols.commands import WorkerId, WorkerLanes
from timeshare.protocols.commands.results import SyncResult
from timeshare.protocols.store import JobStore
from timeshare.state import Phase

NON_DEFAULT_SECTIONS: dict[str, Any] = {
    "transfer": {
        "bucket_mb": 3.0,
        "pipeline_depth": 1,
        "ack_timeout_s": 7.0,
        "finalize_timeout_s": 8.0,
        "handshake_timeout_s": 9.0,
        "begin_timeout_s": 77.0,
        "linger_s": 0.3,
        "checksum": True,
        "transport": "shm",
    },
    "engine": {
        "simulated": {
            "sizes": {
                "device_mb": 1.0,
                "params_mb": 2.0,
                "optimizer_mb": 3.0,
                "staging_mb": 4.0,
                "weights_mb": 5.0,
                "kv_cache_mb": 6.0,
            },
            "engine_span": 3,
            "tensors": 7,
            "tensor_numel": 8,
            "delays": {"train": {"0": 0.1}},
            "account_memory": False,
        }
    },
    "faults": [{"role": "rollout", "rank": 2, "phase": "resume", "kind": "kill"}],
}


def leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        return {
            k: v
            for name, value in data.items()
            for k, v in leaves(value, f"{prefix}{name}.").items()
        }
    return {prefix.rstrip("."): data}


@pytest.mark.asyncio
async def test_transfer_engine_and_faults_reach_every_worker_whole(runtime_dir: Path) -> None:
    cfg = config(runtime_dir, job={"ranks": 3}, **NON_DEFAULT_SECTIONS)
    defaults = leaves(msgspec.to_builtins(Config()))
    chosen = leaves(msgspec.to_builtins(cfg))
    for key in leaves(NON_DEFAULT_SECTIONS):
        if not key.startswith("faults"):
            assert chosen[key] != defaults.get(key), f"{key} is not set to a non-default value"
    async with WorkerLanes.open(runtime_dir / "lanes", stall_timeout_s=1.0) as lanes:
        for rank in range(3):
            for role in ("trainer", "rollout"):
                spec = worker_spec(cfg, WorkerId(role, rank), lanes, ("127.0.0.1", 1234))
                assert spec.transfer == cfg.transfer
                assert spec.engine == cfg.engine
                assert spec.faults == cfg.faults
                assert spec.world_size == 3
                assert spec.checkpoint_dir == f"{cfg.job.checkpoint_dir}/rank{rank}"
                assert spec.weight_endpoint == f"ipc://{cfg.job.runtime_dir}/w-rank{rank}.sock"


@pytest.mark.slow
@pytest.mark.asyncio
async def test_job_keys_act_in_a_real_run(runtime_dir: Path) -> None:
    cfg = config(runtime_dir, job={"ranks": 3, "steps": 7})
    for rank in range(3):  # a durable checkpoint of step 5: the run resumes from it
        directory = Path(cfg.job.checkpoint_dir) / f"rank{rank}"
        directory.mkdir(parents=True)
        (directory / "trainer.json").write_text(json.dumps({"step": 5}))
    store = JobStore.host()
    summary = await run(cfg, store)
    assert (summary.first_step, summary.step) == (5, 7)
    assert len(store.published(0, timeout_s=5.0).phases) == 3
    assert stat.S_IMODE(os.stat(cfg.job.runtime_dir).st_mode) == 0o700
    assert_nothing_left(runtime_dir)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("sections", "cause", "message"),
    [
        (
            {
                "deadlines": {"phase_s": 2.0, "stall_s": 1.0},
                "transfer": {
                    "ack_timeout_s": 1.0,
                    "finalize_timeout_s": 1.0,
                    "handshake_timeout_s": 1.5,
                },
                "engine": {"simulated": {"delays": {"train": {"0": 5.0}}}},
            },
            CommandTimeout,
            r"did not finish train within 2 s",
        ),
        (
            {
                "job": {"ranks": 2},
                "deadlines": {"barrier_s": 0.5},
                "engine": {"simulated": {"delays": {"barrier": {"1": 3.0}}}},
            },
            CollectiveTimeout,
            r"timed out after 0.5 s on rank 0: ranks \[1\] did not arrive",
        ),
        (
            {
                "deadlines": {"phase_s": 12.0, "stall_s": 1.0, "commands": {"offload": 2.5}},
                "engine": {"simulated": {"delays": {"offload": {"0": 6.0}}}},
            },
            CommandTimeout,
            r"did not finish offload within 2.5 s",
        ),
        ({"deadlines": {"ready_s": 0.2}}, WorkersNotReady, r"not ready within 0.2 s"),
        (
            {
                "deadlines": {"stall_s": 1.2},
                "faults": [{"role": "trainer", "rank": 0, "phase": "offload", "kind": "hang"}],
            },
            WorkerStalled,
            r"made no progress in offload for 1.2 s",
        ),
    ],
    ids=["phase_s", "barrier_s", "commands", "ready_s", "stall_s"],
)
async def test_deadline_keys_act_where_they_are_waited_on(
    runtime_dir: Path, sections: dict[str, Any], cause: type[Exception], message: str
) -> None:
    with pytest.raises(CycleFailed) as info:
        await run(config(runtime_dir, **sections))
    assert isinstance(info.value.cause, cause)
    assert re.search(message, str(info.value.cause)), info.value.cause
    assert_nothing_left(runtime_dir)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_transfer_and_engine_keys_act_in_a_real_run(runtime_dir: Path) -> None:
    # 3 tensors of 128 KiB in 256 KiB buckets: two buckets (one at the default 1 MiB).
    cfg = config(
        runtime_dir,
        job={"ranks": 2, "steps": 2},
        transfer={"bucket_mb": 0.25, "pipeline_depth": 1, "checksum": True},
        engine={"simulated": {"tensors": 3, "tensor_numel": 32768, "account_memory": False}},
    )
    summary = await run(cfg)
    syncs = [r for r in summary.reports if r.phase is Phase.SYNC]
    assert sorted((r.step, r.rank) for r in syncs) == [(s, r) for s in range(3) for r in range(2)]
    for report in syncs:
        trainer, rollout = report.trainer, report.rollout
        assert isinstance(trainer, SyncResult) and isinstance(rollout, SyncResult)
        assert trainer.staging_buffers == 1
        for side in (trainer.transfer, rollout.transfer):
            assert (side.tensors, side.bytes) == (3, 3 * 32768 * 4)
            assert side.buckets == side.checksummed == 2
            assert side.version == report.step
    assert_nothing_left(runtime_dir)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("fault", "transfer", "role", "message"),
    [
        # The rollout never answers the invitation: the trainer's handshake ends.
        (
            {"role": "rollout", "phase": "sync", "step": 0},
            {"handshake_timeout_s": 1.5},
            "trainer",
            r"no answer in phase joined .* within 1.5 s, the receiver did not answer",
        ),
        # After the handshake (step 0), the rollout never takes step 1's first bucket.
        (
            {"role": "rollout", "phase": "sync", "step": 1},
            {"ack_timeout_s": 1.25},
            "trainer",
            r"no answer in phase (bucket|released) .* within 1.25 s, waiting for the receiver",
        ),
        # The trainer never begins: the rollout's wait for the first frame ends.
        (
            {"role": "trainer", "phase": "sync", "step": 0},
            {"begin_timeout_s": 1.75, "ack_timeout_s": 1.0},
            "rollout",
            r"begin .*within 1.75 s",
        ),
    ],
    ids=["handshake_timeout_s", "ack_timeout_s", "begin_timeout_s"],
)
async def test_transfer_timeouts_act_in_the_workers(
    runtime_dir: Path, fault: dict[str, Any], transfer: dict[str, float], role: str, message: str
) -> None:
    cfg = config(
        runtime_dir,
        job={"steps": 2},
        # A hung worker reports no progress: the stall deadline must not end the run first.
        deadlines={"phase_s": 12.0, "stall_s": 8.0},
        transfer=transfer,
        faults=[{**fault, "rank": 0, "kind": "hang"}],
    )
    with pytest.raises(CycleFailed) as info:
        await run(cfg)
    failed = info.value
    assert (failed.role, failed.phase, failed.rank) == (role, "sync", 0), failed
    assert isinstance(failed.cause, WorkerError), failed.cause
    assert failed.cause.remote_type == AckTimeout.__name__
    assert re.search(message, failed.cause.remote_message), failed.cause.remote_message
    assert failed.after_s is not None and failed.after_s < 6.0
    assert_nothing_left(runtime_dir)
