"""`timeshare run` with vLLM as the rollout engine: real workers, real vLLM, end to end.

The same job with an engine per rank and with one engine of two TP workers holds the same
weights every step, each with weights_match and the logprob difference; a TP worker SIGKILLed in
the middle of a SYNC fails the cycle naming rank, phase and TP worker, with nothing left behind;
a TP run SIGKILLed leaves no vLLM process; a key vLLM rejects is exit 2 before any process
starts.
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
from tests.daemon.test_run import steps_of, timeshare_run
from tests.engines.foreign_hosts import (
    left_in_shm,
    recorded_processes,
    recorded_segments,
    refused_before_any_process,
    shm_names,
    start_run,
    tp_1_and_tp_2_runs,
    wait_for,
)
from tests.starving import cpu_starved
from timeshare.protocols.weights import sweep_stale
from timeshare.protocols.weights.segments import SEGMENT_PREFIX
from timeshare.runtime import SHM_ROOT as SHM
from timeshare.runtime import mapped_segments, wait_gone

pytestmark = pytest.mark.slow

VLLM_JOB: dict[str, Any] = merged(
    TINY,
    {
        "job": {"ranks": 1, "steps": 3},
        "deadlines": {"phase_s": 120.0, "stall_s": 60.0, "barrier_s": 60.0, "ready_s": 240.0},
        "engine": {
            "rollout": "vllm",
            "torch_ref": {  # head_dim 32: the smallest vLLM's CPU attention takes
                "model": {
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 32,
                }
            },
            "vllm": {"max_model_len": 32, "kv_cache_mb": 16.0, "generate_timeout_s": 90.0},
        },
    },
)


def write_config(root: Path, **sections: Any) -> Path:
    return toml_file(root, VLLM_JOB, log={"file": f"{root}/log.jsonl"}, **sections)


def tp_config(root: Path, tensor_parallel: int, steps: int = 3) -> Path:
    """Two ranks; vLLM with `tensor_parallel` workers: 1 is an engine per rank, 2 one engine
    for both ranks (rank 0 hosts it, its two workers each load every version)."""
    vllm = {"tensor_parallel_size": tensor_parallel}
    return write_config(root, job={"ranks": 2, "steps": steps}, engine={"vllm": vllm})


@pytest.mark.alone
def test_tp_1_and_tp_2_from_one_seed_hold_the_same_weights_every_step(runtime_dir: Path) -> None:
    """The same job with an engine per rank and with one engine of two TP workers for both
    ranks: each step the same weights (bit for bit, every TP worker's included), logprobs within
    fp32 noise of the trainer's, the same rewards; each TP worker loaded every byte sent."""
    runs = tp_1_and_tp_2_runs(runtime_dir, tp_config)
    # vLLM on CPU releases nothing: the summary says what stays resident (a KV cache per vLLM
    # worker: two engines of one worker, or one engine of two)
    assert all(s["rollout_resident_mb"] >= 2 * 16.0 for run in runs.values() for s in run)


@pytest.mark.alone
def test_a_vllm_tp_worker_killed_in_sync_fails_the_cycle_naming_it(runtime_dir: Path) -> None:
    """TP worker 1 of rank 0's engine (which serves ranks 0 and 1) dies in the first SYNC."""
    before = shm_names()
    run = start_run(runtime_dir, tp_config(runtime_dir, 2))
    try:
        processes = wait_for("vLLM", lambda: recorded_processes(runtime_dir / "run"), 240, run)
        worker = next(pid for pid in processes if tp_worker(pid) == 1)
        # The first SYNC: the vLLM worker maps the trainer's staging, buckets are on their way.
        wait_for("staging", lambda: mapped_segments(worker, SEGMENT_PREFIX), 240, run)
        segments = recorded_segments(runtime_dir / "run")
        assert segments  # vLLM's message queues
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        _, stderr = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 1, stderr[-3000:]
    assert time.monotonic() - killed < 120  # within SYNC's deadline (phase_s)
    # The kill lands in the first SYNC while its buckets still flow, or, when that transfer of
    # a tiny model ends first on a loaded machine, in the ROLLOUT that follows: either way the
    # cycle fails naming the rollout and the phase its vLLM died in.
    assert re.search(r"rank 0 failed in phase (sync|rollout)", stderr), stderr[-3000:]
    assert re.search(r"TP worker 1\b|receiver 1 of 2", stderr), stderr[-3000:]
    # The driver waited for its workers; their vLLM children die with their group, just after.
    assert wait_gone(processes, 10) == []
    assert_nothing_left(runtime_dir)
    assert [name for name in segments if (SHM / name).exists()] == []
    assert left_in_shm(before) == []  # nor what the records did not name (the TP all-reduce's)


@pytest.mark.alone
def test_no_vllm_process_outlives_a_run_killed_with_sigkill(runtime_dir: Path) -> None:
    """A TP engine: its EngineCore and both TP workers die with the run."""
    before = shm_names()
    run = start_run(runtime_dir, tp_config(runtime_dir, 2, steps=1000))
    try:
        processes = wait_for("vLLM", lambda: recorded_processes(runtime_dir / "run"), 240, run)
        worker = next(pid for pid in processes if tp_worker(pid) == 1)
        # Killed in the first SYNC: every process of the job is up, staging mapped everywhere.
        wait_for("staging", lambda: mapped_segments(worker, SEGMENT_PREFIX), 240, run)
        processes = recorded_processes(runtime_dir / "run")
        segments = recorded_segments(runtime_dir / "run")
        # the rollout worker, VLLM::EngineCore, VLLM::Worker_TP0 and _TP1
        assert len(processes) >= 4
        assert segments  # vLLM's message queues
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert wait_gone(processes, 10) == []
    sweep_stale(runtime_dir / "run")  # what the next run does first
    assert [name for name in segments if (SHM / name).exists()] == []
    assert left_in_shm(before) == []  # nor what the records did not name (the TP all-reduce's)


@pytest.mark.alone  # held to a share of a CPU: beside other tests it would get less still
def test_a_vllm_sync_starved_of_cpu_is_slow_not_stalled(runtime_dir: Path) -> None:
    """From the first SYNC on, every process of the run (vLLM's EngineCore included) is held to
    0.3 of a CPU by a quota: the stall timeout as it is (10 s), the deadlines that do bound a
    starved job ample. Every step completes, the weights matching. It was starved: a thread of
    the run waited for a CPU, in all, longer than the stall timeout, and the quota held the run
    back as long (where the machine cannot starve it, the test is skipped naming why)."""
    waits = ("ack", "finalize", "handshake", "begin")
    stall_s = 10.0
    config = write_config(
        runtime_dir,
        deadlines={"stall_s": stall_s, "phase_s": 400.0, "barrier_s": 120.0},
        transfer={f"{wait}_timeout_s": 120.0 for wait in waits},
        engine={"vllm": {"generate_timeout_s": 300.0}},
    )
    run = start_run(runtime_dir, config)
    try:
        processes = wait_for("vLLM", lambda: recorded_processes(runtime_dir / "run"), 240, run)
        mapped = lambda: any(mapped_segments(pid, SEGMENT_PREFIX) for pid in processes)  # noqa: E731
        wait_for("the first SYNC", mapped, 240, run)
        tree = [run.pid, *(child.pid for child in psutil.Process(run.pid).children(recursive=True))]
        with cpu_starved(tree, 0.3) as starving:
            _, err = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, f"({starving}) {err}"
    steps = steps_of(runtime_dir / "summary.json")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["weights_match"] for s in steps), steps
    assert starving.waited_s > stall_s, starving
    assert starving.throttled_s is None or starving.throttled_s > stall_s, starving
    assert_nothing_left(runtime_dir)


def tp_worker(pid: int) -> int | None:
    """The TP rank of a vLLM worker process (its title: VLLM::Worker_TP<k>), else None."""
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return None
    found = re.search(r"VLLM::Worker_TP(\d+)", title)
    return int(found.group(1)) if found else None


def test_batch_invariance_asked_of_vllm_on_cpu_is_exit_2_naming_it(runtime_dir: Path) -> None:
    """vLLM has a batch-invariant mode on CUDA only: asked for here, it is refused by name
    before any process starts, never silently off."""
    config = write_config(runtime_dir, engine={"batch_invariant": True})
    refused = "engine.batch_invariant: vLLM has no batch-invariant mode on cpu"
    refused_before_any_process(config, runtime_dir, refused, "Triton")


def test_a_key_vllm_rejects_is_exit_2_before_any_process(runtime_dir: Path) -> None:
    config = write_config(runtime_dir, engine={"vllm": {"engine_args": {"max_num_seqz": 4}}})
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=200)
    assert done.returncode == 2, done.stderr
    assert "engine.vllm.engine_args.max_num_seqz" in done.stderr
    assert not (runtime_dir / "run").exists()
    typed = write_config(runtime_dir, engine={"vllm": {"dtype": "float64"}})
    done = timeshare_run(typed, runtime_dir / "summary.json", timeout_s=200)
    assert done.returncode == 2 and "engine.vllm.dtype" in done.stderr, done.stderr
