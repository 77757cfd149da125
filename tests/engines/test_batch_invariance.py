"""`[engine] batch_invariant` for the engines that run the project's own mode (the reference
trainer and rollout, the FSDP trainer, the Megatron trainer of one TP rank), as verl's
batch-invariance tests test a switch that changes a whole process: each case in a spawned
process (invariance_probe.py), the engines built through the registry, both directions asserted.
And what it is for: a sequence's logprobs alone, beside other neighbours and in the trainer are
the rollout's, bit for bit, and the trainer's of rows of differing lengths, padded into one batch,
are each row's alone. The drift probe finds 0.0 where that holds and a difference where it does
not. The mode is a CPU mode: on CUDA it is refused at config load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.configs import TINY, toml_file
from tests.daemon.test_run import steps_of, timeshare_run
from timeshare.config import load_config
from timeshare.engines.invariance import STRICT_CBWR, STRICT_CBWR_MODE, SWITCH_VARIABLES
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.sglang.spec import SglangSpec
from timeshare.engines.spec import EngineChoice, check_engines, engine_spec
from timeshare.engines.vllm.spec import BATCH_INVARIANT_ENV
from timeshare.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = ["torch_ref", "fsdp", "megatron"]  # each with the reference rollout (megatron TP 1)
SHARDED = ["fsdp", "megatron"]  # the trainers whose device is a key of their own
# TINY's job with a trainer of a model directory (the rollout serves the trainer's model), the
# switch on and the drift probe every step
SHARDED_RUN: dict[str, Any] = {
    "job": {"ranks": 2, "steps": 3},
    "deadlines": {"phase_s": 30.0, "stall_s": 10.0, "ready_s": 90.0},
    "transfer": {"bucket_mb": 0.0625, "checksum": True},
    "engine": {
        "rollout": "torch_ref",
        "batch_invariant": True,
        "task": {"prompts_per_rank": 2, "group_size": 4, "max_completion_tokens": 4},
        "torch_ref": {"kv_cache_len": 16},
    },
    "checks": {"invariance_every": 1},
}
# What the switch-off cases inherit, as a daemon started with them would pass them on: strict
# MKL, and vLLM's batch-invariant kernels asked for.
INHERITED = {"MKL_CBWR": STRICT_CBWR, BATCH_INVARIANT_ENV: "1"}


def probed(switch: str, trainer: str, inherited: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.engines.invariance_probe", switch, trainer],
        cwd=ROOT,
        env={**os.environ, **(inherited or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module", params=TRAINERS)
def on(request: pytest.FixtureRequest) -> dict[str, Any]:
    return probed("on", request.param)


@pytest.fixture(scope="module", params=TRAINERS)
def off(request: pytest.FixtureRequest) -> dict[str, Any]:
    return probed("off", request.param, INHERITED)


def test_on_installs_strict_gemms_and_every_model_runs_the_mode(on: dict[str, Any]) -> None:
    """MKL says it runs the strict mode (the GEMM probe alone cannot tell it on a CPU where
    plain MKL rounds those rows alike too)."""
    assert on["cbwr"] == STRICT_CBWR
    assert on["mkl_cbwr"] == STRICT_CBWR_MODE
    assert on["gemm_row_invariant"] is True
    for model, (flagged, modules) in on["flagged"].items():
        assert modules > 0 and flagged == modules, model


def test_off_installs_nothing(off: dict[str, Any]) -> None:
    """No strict-MKL mode asked for, none run, no module switched. (Whether plain MKL's GEMMs
    round 5 rows as 8 is the CPU's: they did apart on the AVX2 machine of the first
    measurements, and alike on this session's AVX-512 Xeon, so it says nothing about the
    switch.)"""
    assert off["cbwr"] is None
    assert off["mkl_cbwr"] != STRICT_CBWR_MODE
    assert all(flagged == 0 for flagged, _ in off["flagged"].values()), off["flagged"]


def test_off_the_switches_it_inherited_are_removed(off: dict[str, Any]) -> None:
    """The process was started with MKL_CBWR and VLLM_BATCH_INVARIANT set: the engines built
    through the registry (as a worker builds them) removed both, before MKL's first GEMM, from
    their process and so from every process it starts (as vLLM's engine is started)."""
    nothing = dict.fromkeys(SWITCH_VARIABLES)
    assert set(INHERITED) == set(SWITCH_VARIABLES)
    assert off["switches"] == {"here": nothing, "child": nothing}


def test_the_engine_refuses_to_start_when_mkl_already_ran() -> None:
    """MKL reads MKL_CBWR once, at its first GEMM: after one, the switch could not take, and
    the trainer is not built."""
    refused = probed("late", "torch_ref")["refused"]
    assert f"engine.batch_invariant: MKL_CBWR={STRICT_CBWR} did not take" in refused


def test_on_a_sequence_is_the_same_alone_beside_others_and_in_the_trainer(
    on: dict[str, Any],
) -> None:
    assert on["alone_vs_batch"] == 0.0
    assert on["beside_vs_batch"] == 0.0
    assert on["trainer_vs_rollout"] == 0.0


def test_on_the_drift_probe_finds_0_0_and_a_perturbed_weight(on: dict[str, Any]) -> None:
    """The worker's drift probe (drift.py) on the batch: exactly 0.0 where invariance holds; a
    difference once a weight of the rollout moved after it sampled the batch (lm_head's, by
    1e-3 of itself), far above fp32's noise: the probe is not fixed at 0.0."""
    assert on["drift"] == 0.0
    assert on["drift_perturbed"] > 1e-4


def test_on_rows_of_differing_lengths_are_the_same_alone_and_padded_in_a_batch(
    on: dict[str, Any],
) -> None:
    """Prompts of 3, 4 and 5 tokens, completions of 1 to 5 (some stopped at EOS), right-padded
    into one batch: the trainer gives each row, to the bit, what it gives the row alone (a batch
    of one, of its own length), and what the rollout gives it."""
    lengths = on["uneven_lengths"]
    assert {p for p, _ in lengths} == {3, 4, 5} and {c for _, c in lengths} == {1, 2, 3, 4, 5}
    assert on["trainer_uneven_alone_vs_batch"] == 0.0
    assert on["trainer_vs_rollout_uneven"] == 0.0


def test_off_the_differences_are_fp32_noise(off: dict[str, Any]) -> None:
    """What batch invariance removes, as measured here (not a failure: the default mode). On
    this batch fp32 does differ, trainer against rollout and a sequence re-scored alone against
    its batch (GEMMs of 1 row and of 8, prefill and decode attention), and the drift probe, the
    same re-scoring as the worker runs it, finds it: neither can be fixed at 0.0."""
    print({k: off[k] for k in ("alone_vs_batch", "beside_vs_batch", "trainer_vs_rollout")})
    assert 0.0 < off["trainer_vs_rollout"] < 1e-4
    assert 0.0 < off["alone_vs_batch"] < 1e-4 and off["beside_vs_batch"] < 1e-4
    assert 0.0 < off["drift"] < 1e-4
    assert off["drift_perturbed"] > 1e-4
    assert off["trainer_uneven_alone_vs_batch"] < 1e-4
    assert off["trainer_vs_rollout_uneven"] < 1e-4


def test_an_engine_without_a_mode_is_refused_by_name() -> None:
    spec = engine_spec(trainer="simulated", rollout="simulated", batch_invariant=True)
    refused = r"engine.batch_invariant \(from default\): the simulated engine has no"
    with pytest.raises(ConfigError, match=refused):
        check_engines(spec, probe=False)


def test_megatron_with_tensor_parallelism_is_refused_by_name() -> None:
    """Its row-parallel layers all-reduce partial sums: no mode can make that one GEMM's."""
    megatron = {"model_dir": "/nonexistent", "tensor_parallel_size": 2}
    spec = engine_spec(
        trainer="megatron", rollout="torch_ref", batch_invariant=True, megatron=megatron
    )
    refused = "engine.batch_invariant: megatron has no batch-invariant mode with engine.megatron"
    with pytest.raises(ConfigError, match=refused):
        check_engines(spec, probe=False)


@pytest.mark.parametrize("trainer", SHARDED)
def test_the_own_mode_on_cuda_is_refused_by_name(trainer: str, tmp_path: Path) -> None:
    """A CPU mode: on CUDA the trainer's GEMMs are cuBLAS's. `device = "cuda"` is refused by
    the config's quick check, on any machine; "auto" passes it (the probe resolves it)."""
    model_dir = str(init_model_dir(tmp_path / "model", ModelShape(), seed=0))

    def spec_on(device: str) -> EngineChoice:
        table = {"model_dir": model_dir, "device": device}
        return engine_spec(
            trainer=trainer,
            rollout="torch_ref",
            batch_invariant=True,
            torch_ref={"kv_cache_len": 16},
            **{trainer: table},
        )

    refused = (
        rf'engine.{trainer}.device = "cuda" \(from default\): engine.batch_invariant runs this '
        rf'engine in the project\'s own mode, a CPU mode .* Set engine.{trainer}.device = "cpu"'
    )
    with pytest.raises(ConfigError, match=refused):
        check_engines(spec_on("cuda"), probe=False)
    for device in ("auto", "cpu"):
        check_engines(spec_on(device), probe=False)


@pytest.mark.parametrize("trainer", SHARDED)
def test_auto_that_is_cuda_is_refused_by_the_probe_and_by_the_worker(
    trainer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch sees a CUDA device (made so here), "auto" is CUDA: the config's probe (its
    check in the child process, which asks torch as the worker does) refuses it naming the
    key, and so does the trainer as it is built (a process that resolved it otherwise)."""
    import torch

    from timeshare.engines.fsdp import check as fsdp_check
    from timeshare.engines.fsdp.trainer import FsdpTrainer
    from timeshare.engines.megatron import check as megatron_check
    from timeshare.engines.megatron.trainer import MegatronTrainer

    model_dir = init_model_dir(tmp_path / "model", ModelShape(), seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    refused = f'engine.{trainer}.device = "auto" is cuda here'
    if trainer == "fsdp":
        verdict = fsdp_check._verdict(fsdp_check.ProbeRequest(str(model_dir), cpu_only=True))
    else:
        request = megatron_check.ProbeRequest(str(model_dir), tp=1, cpu_only=True)
        verdict = megatron_check._verdict(request)
    assert verdict["ok"] is False and str(verdict["error"]).startswith(refused), verdict
    spec = engine_spec(
        trainer=trainer,
        rollout="torch_ref",
        batch_invariant=True,
        **{trainer: {"model_dir": str(model_dir)}},
    )
    built = FsdpTrainer if trainer == "fsdp" else MegatronTrainer
    with pytest.raises(ConfigError, match=f'engine.{trainer}.device = "auto" is cuda here'):
        built(0, 1, spec)


@pytest.mark.gpu
@pytest.mark.parametrize("trainer", SHARDED)
def test_on_cuda_auto_is_refused_at_config_load(trainer: str, tmp_path: Path) -> None:
    """Where a GPU is: the job's "auto" trainer under the switch, refused by its probe."""
    model_dir = init_model_dir(tmp_path / "model", ModelShape(), seed=0)
    spec = engine_spec(
        trainer=trainer,
        rollout="torch_ref",
        batch_invariant=True,
        torch_ref={"kv_cache_len": 16},
        **{trainer: {"model_dir": str(model_dir)}},
    )
    with pytest.raises(ConfigError, match=f'engine.{trainer}.device = "auto" is cuda here'):
        check_engines(spec)


def test_sglang_on_cuda_with_torch_native_is_refused_naming_the_backend() -> None:
    """SGLang's deterministic inference refuses torch_native (the default: SGLang's CPU
    engine's): on a device set to "cuda" the config's check says so, naming the key and what to
    set. ("auto" is the probe's, in SGLang's venv, with SGLang's own list:
    tests/engines/sglang/test_cuda.py.)"""
    spec = engine_spec(
        trainer="torch_ref", rollout="sglang", batch_invariant=True, sglang={"device": "cuda"}
    )
    refused = (
        r"engine.sglang.attention_backend \('torch_native'\): engine.batch_invariant runs SGLang "
        r"with its deterministic inference, which does not take that backend; set "
        r"engine.sglang.attention_backend to one it takes on cuda \(triton, flashinfer or fa3\)"
    )
    with pytest.raises(ConfigError, match=refused):
        check_engines(spec, probe=False)
    triton = engine_spec(
        trainer="torch_ref",
        rollout="sglang",
        batch_invariant=True,
        sglang={"device": "cuda", "attention_backend": "triton"},
    )
    check_engines(triton, probe=False)
    # the probe's rule, with SGLang's list: a backend outside it is refused too
    takes = ("fa3", "flashinfer", "triton")
    assert SglangSpec(attention_backend="triton").deterministic_problem("cuda", takes) == ""
    wrong = SglangSpec(attention_backend="flashmla").deterministic_problem("cuda", takes)
    assert wrong.startswith("engine.sglang.attention_backend ('flashmla')"), wrong
    assert SglangSpec().deterministic_problem("cpu", takes) == ""  # (cpu: refused elsewhere)


def test_the_own_mode_takes_one_thread() -> None:
    spec = engine_spec(
        trainer="torch_ref", rollout="torch_ref", batch_invariant=True, torch_threads=2
    )
    refused = r"engine.torch_threads \(2, from default\): engine.batch_invariant"
    with pytest.raises(ConfigError, match=refused):
        check_engines(spec, probe=False)


@pytest.mark.slow
def test_a_run_with_the_switch_on_is_on_policy_to_the_bit(runtime_dir: Path) -> None:
    """Real workers, every step: the trainer's logprobs of what the rollout sampled are the
    rollout's own, difference 0.0 (the demo's own figures: the README's table)."""
    config = toml_file(
        runtime_dir,
        TINY,
        engine={"batch_invariant": True},
        checks={"invariance_every": 1},  # and the drift probe every step
        log={"file": f"{runtime_dir}/log"},
    )
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = steps_of(runtime_dir / "summary.json")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["logprob_max_abs_diff"] for s in steps] == [0.0, 0.0, 0.0]
    assert [s["invariance_max_abs_diff"] for s in steps] == [0.0, 0.0, 0.0]
    assert all(s["weights_match"] for s in steps)
    assert "drift 0.0e+00" in done.stdout  # the line of each step


@pytest.mark.slow
@pytest.mark.parametrize("trainer", SHARDED)
def test_a_sharded_trainer_run_with_the_switch_on_is_on_policy_to_the_bit(
    trainer: str, runtime_dir: Path
) -> None:
    """Real workers on two ranks (FSDP sharded over both; Megatron of one TP rank, data-parallel
    over both), a model directory made now: the trainer's logprobs of what the rollout sampled
    are the rollout's own, and the drift probe finds 0.0, at every step."""
    model_dir = init_model_dir(runtime_dir / "model", ModelShape(), seed=0)
    config = toml_file(
        runtime_dir,
        SHARDED_RUN,
        # (on the CPU where a GPU is too: the project's mode is a CPU mode)
        engine={"trainer": trainer, trainer: {"model_dir": str(model_dir), "device": "cpu"}},
        log={"file": f"{runtime_dir}/log"},
    )
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = steps_of(runtime_dir / "summary.json")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["logprob_max_abs_diff"] for s in steps] == [0.0, 0.0, 0.0]
    assert [s["invariance_max_abs_diff"] for s in steps] == [0.0, 0.0, 0.0]
    assert all(s["weights_match"] for s in steps)


@pytest.mark.slow
def test_the_drift_probe_runs_on_its_steps_and_measures_the_default_mode(
    runtime_dir: Path,
) -> None:
    """[checks] invariance_every = 2, the switch off: steps 2 and 4 probed, the others not;
    what it finds is fp32's noise, in the summary and in `timeshare report --text`."""
    config = toml_file(
        runtime_dir,
        TINY,
        job={"steps": 4},
        checks={"invariance_every": 2, "invariance_samples": 3},
        log={"file": f"{runtime_dir}/log"},
    )
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    drifts = [s["invariance_max_abs_diff"] for s in steps_of(runtime_dir / "summary.json")]
    assert drifts[0] is None and drifts[2] is None
    # fp32 differs on these batches: a probe fixed at 0.0 would fail here (and the run with the
    # switch on, above, requires exactly 0.0)
    assert all(d is not None and 0.0 < d < 1e-4 for d in (drifts[1], drifts[3])), drifts
    report = subprocess.run(
        [sys.executable, "-m", "timeshare", "report", str(runtime_dir), "--text"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    largest = max(d for d in drifts if d is not None)
    assert f"drift    a sequence alone / in its batch: {largest:.1e} at most" in report.stdout
    # and on the timeline: each ROLLOUT's record (what the trace shows as the slice's args)
    rollouts = [
        record["record"]
        for record in map(json.loads, (runtime_dir / "log").read_text().splitlines())
        if record.get("event") == "cycle.phase.ended" and record["record"]["phase"] == "rollout"
    ]
    probed: dict[int, list[float]] = {}
    for r in rollouts:  # every rank's record of each step
        if (drift := r["figures"]["rollout.invariance_max_abs_diff"]) is not None:
            probed.setdefault(r["step"], []).append(drift)
    assert set(probed) == {2, 4}
    # each probed step's figure in the summary is the largest of its ranks' records
    by_step = {step: max(values) for step, values in probed.items()}
    assert by_step == {2: drifts[1], 4: drifts[3]}, (probed, drifts)


def test_the_drift_probe_needs_a_rollout_that_can_rescore(tmp_path: Path) -> None:
    config = toml_file(tmp_path, TINY, engine={"rollout": "vllm"}, checks={"invariance_every": 1})
    refused = r"checks.invariance_every \(1, from file .*\): the vllm rollout cannot re-score"
    with pytest.raises(ConfigError, match=refused):
        load_config(config, environ={}, probe=False)
