"""`timeshare plan` over the recipes: every recipe plans, and each rule, broken once, is exit 2
with an error naming the rule, the key and the numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from timeshare.capacity import rules
from timeshare.capacity.model_size import count
from timeshare.daemon.cli import main
from timeshare.engines.footprint import RolloutFootprint, TrainerFootprint

ROOT = Path(__file__).parents[2]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*/job.toml"))
MOE = ROOT / "examples/recipes/moe-235b-32-nodes/job.toml"
DENSE = ROOT / "examples/recipes/dense-7b-8-gpus/job.toml"


@pytest.fixture(autouse=True)
def from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # recipes name their model directories from there


def test_there_are_recipes_for_32_nodes_and_for_one_node_of_8() -> None:
    assert {r.parent.name for r in RECIPES} >= {"moe-235b-32-nodes", "dense-7b-8-gpus"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.parent.name for r in RECIPES])
def test_every_recipe_plans(recipe: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = subprocess.run(
        [sys.executable, "-m", "timeshare", "plan", str(recipe), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": feasible" in done.stdout
    plan = json.loads(out.read_text())
    assert plan["feasible"] and plan["problems"] == []
    totals = plan["device_gib"]["totals"]
    assert 0 < max(totals.values()) <= plan["cluster"]["device_gib"]
    for phase, total in totals.items():  # the table's columns are the sums of its parts
        parts = [p["gib"] for p in plan["device_gib"]["parts"] if phase in p["phases"]]
        assert total == pytest.approx(sum(parts))


def plan_errors(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", *argv]) == 2
    return capsys.readouterr().err


def test_a_tensor_parallel_group_across_nodes_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = plan_errors(capsys, str(MOE), "--ranks-per-node", "6")
    # Refused as the config loads (what `timeshare run` does too), naming the key.
    assert "engine.vllm.tensor_parallel_size (8, from file" in err
    assert "must divide the ranks of a node (6)" in err


def test_heads_that_do_not_split_over_the_group_are_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESHARE_ENGINE__VLLM__TENSOR_PARALLEL_SIZE", "8")
    err = plan_errors(capsys, str(DENSE))
    assert (
        "engine.vllm.tensor_parallel_size (8) does not divide the model's attention "
        "heads (28) (from env TIMESHARE_ENGINE__VLLM__TENSOR_PARALLEL_SIZE" in err
    )


def test_key_value_heads_must_split_or_replicate_evenly() -> None:
    model = count(
        {
            "hidden_size": 1536,
            "num_hidden_layers": 2,
            "vocab_size": 64,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "intermediate_size": 64,
        },
        "model",
    )
    trainer = TrainerFootprint(1, "", 1, 1, 4, 4, gathers_layers=False, micro_batch=0)
    rollout = RolloutFootprint(6, "engine.vllm.tensor_parallel_size", 2, 1.0, None, None, "kv", 8)
    (problem,) = rules.heads_rules(model, trainer, rollout)
    assert problem.message == (
        "engine.vllm.tensor_parallel_size (6) neither divides the model's key/value heads (4) "
        "nor is a multiple of them"
    )
    assert rules.heads_rules(model, trainer, rollout._replace(tensor_parallel=2)) == []


def test_a_phase_larger_than_the_device_is_refused_naming_its_parts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = plan_errors(capsys, str(MOE), "--device-gib", "80")
    assert (
        "[memory] ROLLOUT needs 94.7 GiB on each rank, more than cluster.device_gib (80 GiB)" in err
    )
    assert "rollout weights (1/8) 54.7, KV cache 40.0 GiB" in err
    # activations of the longest sequence: max_prompt_tokens + max_completion_tokens
    assert "[memory] TRAIN needs 84.8 GiB on each rank" in err
    assert "activations (1 x 5120 tokens) 59.5" in err


def test_fewer_nodes_than_the_model_needs_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = plan_errors(capsys, str(MOE), "--nodes", "4")
    assert "[memory] TRAIN needs 180.6 GiB on each rank" in err
    assert "AdamW moments (2 x float32, 1/32) 54.7" in err


def test_an_unstated_device_size_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESHARE_CLUSTER__DEVICE_GIB", "0")
    err = plan_errors(capsys, str(DENSE))
    assert "[memory] cluster.device_gib is not stated: give --device-gib" in err


def test_a_kv_cache_shorter_than_the_longest_sequence_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESHARE_ENGINE__VLLM__KV_CACHE_MB", "64")
    err = plan_errors(capsys, str(DENSE))
    # 64 MiB at 56 KiB a token (28 layers x 4 kv heads x 128 x 2 x bf16)
    assert "[kv_cache] the KV cache (engine.vllm.kv_cache_mb) holds 1170 tokens on each rank" in err
    assert "fewer than the longest sequence the rollout serves (4096 tokens)" in err


def test_a_sync_longer_than_its_deadline_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = plan_errors(capsys, str(MOE), "--sync-gbps", "1")
    assert "[sync] a SYNC moves 437.9 GiB per rank: 470.2 s at cluster.sync_gbps (1 GB/s)" in err
    assert "not within deadlines.commands.sync (300 s)" in err
    assert "transfer.ack_timeout_s" not in err  # a 1 GiB bucket: 1.1 s of 60
    err = plan_errors(capsys, str(MOE), "--sync-gbps", "0.01")
    assert (
        "[sync] one bucket takes 107.4 s at cluster.sync_gbps (0.01 GB/s), not within "
        "transfer.ack_timeout_s (60 s)" in err
    )


def test_the_configs_own_checks_come_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "examples/simulated.toml"), "--device-gib", "80"]) == 2
    assert "engine.trainer = 'simulated' says nothing of what it holds" in capsys.readouterr().err
