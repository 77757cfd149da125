"""`[engine] batch_invariant` for the engines that run the project's own mode (the reference
trainer and rollout, the FSDP trainer, the Megatron trainer of one TP rank), as verl's
batch-invariance tests test a switch that changes a whole process: each case in a spawned
process (invariance_probe.py), the engines built through the registry, both directions asserted.
And what it is for: a sequence's logprobs alone, beside other neighbours and in the trainer are
the rollout's, bit for bit, and the trainer's of rows of differing lengths, padded into one batch,
are each row's alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.configs import TINY, toml_file
from tests.daemon.test_run import steps_of, timeshare_run
from timeshare.config import load_config
from timeshare.engines.invariance import STRICT_CBWR
from timeshare.engines.spec import check_engines, engine_spec
from timeshare.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = ["torch_ref", "fsdp", "megatron"]  # each with the reference rollout (megatron TP 1)


def probed(switch: str, trainer: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.engines.invariance_probe", switch, trainer],
        cwd=ROOT,
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
    return probed("off", request.param)


def test_on_installs_strict_gemms_and_every_model_runs_the_mode(on: dict[str, Any]) -> None:
    assert on["cbwr"] == STRICT_CBWR
    assert on["gemm_row_invariant"] is True
    for model, (flagged, modules) in on["flagged"].items():
        assert modules > 0 and flagged == modules, model


def test_off_installs_nothing(off: dict[str, Any]) -> None:
    """No strict-MKL mode asked for, no module switched. (Whether plain MKL's GEMMs round 5
    rows as 8 is the CPU's: they did apart on the AVX2 machine of the first measurements, and
    alike on this session's AVX-512 Xeon, so it says nothing about the switch.)"""
    assert off["cbwr"] is None
    assert all(flagged == 0 for flagged, _ in off["flagged"].values()), off["flagged"]


def test_on_a_sequence_is_the_same_alone_beside_others_and_in_the_trainer(
    on: dict[str, Any],
) -> None:
    assert on["alone_vs_batch"] == 0.0
    assert on["beside_vs_batch"] == 0.0
    assert on["trainer_vs_rollout"] == 0.0


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
    """What batch invariance removes, as measured here (not a failure: the default mode)."""
    print({k: off[k] for k in ("alone_vs_batch", "beside_vs_batch", "trainer_vs_rollout")})
    assert 0.0 < off["trainer_vs_rollout"] < 1e-4
    assert off["alone_vs_batch"] < 1e-4 and off["beside_vs_batch"] < 1e-4
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
    assert all(d is not None and d < 1e-4 for d in (drifts[1], drifts[3])), drifts
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
