"""`timeshare run` with SGLang as the rollout engine: real workers, real SGLang, end to end.

The same job with an engine per rank and with one engine of two TP ranks holds the same weights
every step, each with weights_match and the logprob difference; a TP rank's scheduler SIGKILLed
in the middle of a SYNC fails the cycle naming rank, phase and TP worker, with nothing left
behind; a TP run SIGKILLed leaves no SGLang process; a key SGLang rejects is exit 2 before any
process starts.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.configs import TINY, merged, toml_file
from tests.cycle.jobs import assert_nothing_left
from tests.daemon.test_run import timeshare_run
from tests.engines.foreign_hosts import (
    left_in_shm,
    recorded_processes,
    refused_before_any_process,
    shm_names,
    start_run,
    tp_1_and_tp_2_runs,
    wait_for,
)
from timeshare.protocols.weights import sweep_stale
from timeshare.protocols.weights.segments import SEGMENT_PREFIX
from timeshare.runtime import mapped_segments, wait_gone

pytestmark = pytest.mark.slow

SGLANG_JOB: dict[str, Any] = merged(
    TINY,
    {
        "job": {"ranks": 1, "steps": 3},
        "deadlines": {"phase_s": 120.0, "stall_s": 60.0, "barrier_s": 60.0, "ready_s": 240.0},
        "engine": {
            "rollout": "sglang",
            "sglang": {"max_total_tokens": 1024, "generate_timeout_s": 90.0},
        },
    },
)


def write_config(root: Path, **sections: Any) -> Path:
    return toml_file(root, SGLANG_JOB, log={"file": f"{root}/log.jsonl"}, **sections)


def is_scheduler(pid: int) -> bool:
    try:
        return " ".join(psutil.Process(pid).cmdline()).startswith("sglang::scheduler")
    except psutil.NoSuchProcess:
        return False


def tp_config(root: Path, tensor_parallel: int, steps: int = 3) -> Path:
    """Two ranks; SGLang with `tensor_parallel` ranks: 1 is an engine per rank, 2 one engine
    for both ranks (rank 0 hosts it, both TP ranks' schedulers load every version)."""
    sglang = {"tp_size": tensor_parallel}
    return write_config(root, job={"ranks": 2, "steps": steps}, engine={"sglang": sglang})


def scheduler_rank(pid: int) -> int | None:
    """The TP rank of an SGLang scheduler (its title: sglang::scheduler_TP<k>; 0 without TP)."""
    if not is_scheduler(pid):
        return None
    found = re.search(r"_TP(\d+)", " ".join(psutil.Process(pid).cmdline()))
    return int(found.group(1)) if found else 0


def test_tp_1_and_tp_2_from_one_seed_hold_the_same_weights_every_step(runtime_dir: Path) -> None:
    """The same job with an engine per rank and with one engine of two TP ranks for both:
    each step the same weights (bit for bit, every TP rank's included), logprobs within fp32
    noise of the trainer's, the same rewards; each TP rank loaded every byte sent."""
    runs = tp_1_and_tp_2_runs(runtime_dir, tp_config)
    # SGLang on CPU releases nothing: the summary says what stays resident
    assert all(s["rollout_resident_mb"] > 0 for run in runs.values() for s in run)


def test_an_sglang_tp_scheduler_killed_in_sync_fails_the_cycle_naming_it(
    runtime_dir: Path,
) -> None:
    """TP rank 1's scheduler of rank 0's engine (which serves ranks 0 and 1) dies in SYNC."""
    before = shm_names()
    run = start_run(runtime_dir, tp_config(runtime_dir, 2))
    try:
        processes = wait_for("SGLang", lambda: recorded_processes(runtime_dir / "run"), 240, run)
        scheduler = next(pid for pid in processes if scheduler_rank(pid) == 1)
        # The first SYNC: the scheduler maps the trainer's staging, buckets are on their way.
        wait_for("staging", lambda: mapped_segments(scheduler, SEGMENT_PREFIX), 240, run)
        killed = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        _, stderr = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 1, stderr[-3000:]
    assert time.monotonic() - killed < 120  # within SYNC's deadline (phase_s)
    # The kill lands in the first SYNC while its buckets still flow, or, when that transfer of
    # a tiny model ends first, in the ROLLOUT that follows.
    assert re.search(r"rank 0 failed in phase (sync|rollout)", stderr), stderr[-3000:]
    assert re.search(r"TP worker 1\b|receiver 1 of 2", stderr), stderr[-3000:]
    assert wait_gone(processes, 10) == []
    assert_nothing_left(runtime_dir)
    assert left_in_shm(before) == []


def test_no_sglang_process_outlives_a_run_killed_with_sigkill(runtime_dir: Path) -> None:
    before = shm_names()
    run = start_run(runtime_dir, tp_config(runtime_dir, 2, steps=1000))  # a TP engine
    try:
        processes = wait_for("SGLang", lambda: recorded_processes(runtime_dir / "run"), 240, run)
        scheduler = next(pid for pid in processes if scheduler_rank(pid) == 1)
        # Killed in the first SYNC: every process of the job is up, staging mapped everywhere.
        wait_for("staging", lambda: mapped_segments(scheduler, SEGMENT_PREFIX), 240, run)
        processes = recorded_processes(runtime_dir / "run")
        assert sum(is_scheduler(pid) for pid in processes) == 2  # TP ranks 0 and 1
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert wait_gone(processes, 10) == []  # the rollout worker and SGLang's processes
    sweep_stale(runtime_dir / "run")  # what the next run does first
    assert left_in_shm(before) == []


def test_batch_invariance_asked_of_sglang_on_cpu_is_exit_2_naming_it(runtime_dir: Path) -> None:
    """SGLang has a batch-invariant mode on CUDA only: asked for here, it is refused by name
    before any process starts, never silently off."""
    config = write_config(runtime_dir, engine={"batch_invariant": True})
    refused = "engine.batch_invariant: SGLang has no batch-invariant mode on cpu"
    refused_before_any_process(config, runtime_dir, refused, "torch_native")


def test_a_key_sglang_rejects_is_exit_2_before_any_process(runtime_dir: Path) -> None:
    config = write_config(runtime_dir, engine={"sglang": {"server_args": {"max_runing": 4}}})
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=200)
    assert done.returncode == 2, done.stderr
    assert "engine.sglang.server_args.max_runing" in done.stderr
    assert not (runtime_dir / "run").exists()
    bad_value = write_config(runtime_dir, engine={"sglang": {"server_args": {"load_format": "x"}}})
    done = timeshare_run(bad_value, runtime_dir / "summary.json", timeout_s=200)
    assert done.returncode == 2 and "engine.sglang.server_args.load_format" in done.stderr, (
        done.stderr
    )
    typed = write_config(runtime_dir, engine={"sglang": {"dtype": "float64"}})
    done = timeshare_run(typed, runtime_dir / "summary.json", timeout_s=200)
    assert done.returncode == 2 and "engine.sglang.dtype" in done.stderr, done.stderr
