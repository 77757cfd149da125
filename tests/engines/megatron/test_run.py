"""`timeshare run` with the Megatron trainer, tensor-parallel over two ranks: real workers,
gloo, end to end, as a user runs it.

Ten steps of the digit task learn (weights_match every step); a run SIGKILLed mid-step resumes
at its committed step with the same rewards; what does not split over the ranks is exit 2 before
any worker; the checkpoint exported with `timeshare export` loads in transformers, and vLLM
engine starts from it and receives every later version from the Megatron trainer.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.configs import merged, toml_file
from tests.cycle.jobs import assert_nothing_left
from tests.daemon.test_run import steps_of, timeshare_run
from tests.engines.fsdp.test_run import greedy_reward
from tests.engines.vllm.test_run import VLLM_JOB
from tests.shared_runs import shared_run
from timeshare.config import load_config
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.errors import ConfigError

pytestmark = pytest.mark.slow

KEY = "megatron-learned"  # of its shared run
STEPS = 10
ROOT = Path(__file__).resolve().parents[3]
# The digit task at the size examples/megatron-grpo.toml runs (head_dim 32, as vLLM's CPU
# attention needs), TP=2 over two ranks.
SHAPE = ModelShape(layers=2, hidden=192, intermediate=384, heads=6, kv_heads=6, vocab=16)
MEGATRON_JOB: dict[str, Any] = {
    "job": {"ranks": 2, "steps": STEPS},
    "deadlines": {"phase_s": 60.0, "stall_s": 20.0, "barrier_s": 30.0, "ready_s": 120.0},
    "transfer": {"bucket_mb": 1.0, "checksum": True},
    "engine": {
        "trainer": "megatron",
        "rollout": "torch_ref",
        "task": {"prompts_per_rank": 16, "group_size": 16, "max_completion_tokens": 6},
        "grpo": {"lr": 0.003, "minibatches": 2},
        "megatron": {"tensor_parallel_size": 2, "micro_batch_size": 64},
    },
}


def write_config(root: Path, model_dir: Path, steps: int, **sections: Any) -> Path:
    return toml_file(
        root,
        MEGATRON_JOB,
        job=merged({"steps": steps}, sections.pop("job", {})),
        engine=merged({"megatron": {"model_dir": str(model_dir)}}, sections.pop("engine", {})),
        log={"file": f"{root}/log.jsonl"},
        **sections,
    )


@dataclass(frozen=True)
class Learned:
    root: Path
    model_dir: Path
    done: subprocess.CompletedProcess[str]

    @property
    def steps(self) -> list[dict[str, Any]]:
        return steps_of(self.root / "summary.json")


@pytest.fixture(scope="module")
def learned() -> Learned:
    """Made once a session, whichever worker asks first (tests/shared_runs.py)."""

    def run(root: Path) -> subprocess.CompletedProcess[str]:
        model_dir = init_model_dir(root / "model", SHAPE, seed=0)
        config = write_config(root, model_dir, STEPS)
        return timeshare_run(config, root / "summary.json", timeout_s=600)

    root, done = shared_run(KEY, run, timeout_s=900)
    return Learned(root, root / "model", done)


def test_ten_steps_learn_the_task_with_the_weights_matching_every_step(learned: Learned) -> None:
    assert learned.done.returncode == 0, learned.done.stderr
    steps = learned.steps
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for entry in steps:
        assert entry["weights_match"] and entry["ranks_agree"], entry
        assert entry["logprob_max_abs_diff"] < 1e-4
        assert entry["committed_step"] == entry["step"]
        assert entry["sync"]["bytes"] > 0
    rewards = [s["reward_mean"] for s in steps]
    assert max(rewards[-3:]) - rewards[0] >= 0.3, rewards
    assert_nothing_left(learned.root)


def test_a_run_killed_mid_step_resumes_with_the_same_rewards(
    learned: Learned, runtime_dir: Path
) -> None:
    assert learned.done.returncode == 0, learned.done.stderr
    expected = [(s["step"], s["reward_mean"]) for s in learned.steps[:5]]
    # Killed at the worst moment: step 3's TRAIN is committed on every rank, its ROLLOUT hangs.
    hang = {"role": "rollout", "rank": 0, "phase": "rollout", "kind": "hang", "step": 3}
    summary = runtime_dir / "summary.json"
    config = write_config(runtime_dir, learned.model_dir, 5, faults=[hang])
    first = subprocess.Popen(
        [sys.executable, "-m", "timeshare", "run", str(config), "--summary", str(summary)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    committed = runtime_dir / "checkpoints" / "megatron" / "step-00000003"
    deadline = time.monotonic() + 180
    while not all((committed / f"rank{r}.pt").exists() for r in (0, 1)):
        assert first.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "step 3 was never committed"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert [s["step"] for s in steps_of(summary)] == [1, 2]
    # What a kill in the middle of step 4's checkpoint leaves: the layout and TP rank 0's
    # shards, TP rank 1's never written. Not committed: the run resumes at 3 and redoes 4.
    partial = runtime_dir / "checkpoints" / "megatron" / "step-00000004"
    shutil.copytree(committed, partial)
    (partial / "tp1.pt").unlink()

    done = timeshare_run(write_config(runtime_dir, learned.model_dir, 5), summary)
    assert done.returncode == 0, done.stderr
    assert "(2 steps this run)" in done.stdout  # resumed at the committed step 3
    steps = steps_of(summary)
    assert [(s["step"], s["reward_mean"]) for s in steps] == expected
    assert [s["step"] for s in steps if s["resumed"]] == [3]
    assert all(s["weights_match"] for s in steps)
    assert (partial / "tp1.pt").exists()  # step 4 was redone whole
    assert_nothing_left(runtime_dir)


def test_what_does_not_split_is_exit_2_before_any_worker(
    learned: Learned, runtime_dir: Path
) -> None:
    three_ranks = write_config(runtime_dir, learned.model_dir, 2, job={"ranks": 3})
    done = timeshare_run(three_ranks, runtime_dir / "s.json", 120)
    assert done.returncode == 2, done.stderr
    assert "engine.megatron.tensor_parallel_size (2) does not divide job.ranks (3)" in done.stderr
    four_way = write_config(
        runtime_dir,
        learned.model_dir,
        2,
        job={"ranks": 4},
        engine={"megatron": {"tensor_parallel_size": 4}},
    )
    done = timeshare_run(four_way, runtime_dir / "s.json", 120)
    assert done.returncode == 2, done.stderr
    assert "tensor_parallel_size (4) does not divide num_attention_heads (6)" in done.stderr
    assert not (runtime_dir / "run").exists()  # no worker, not even a runtime directory


def test_the_export_is_the_trained_model_for_transformers_and_vllm(
    learned: Learned, runtime_dir: Path
) -> None:
    assert learned.done.returncode == 0, learned.done.stderr
    exported = runtime_dir / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "timeshare", "export", str(learned.root / "checkpoints"), exported],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"step-{STEPS:08d}" in done.stdout  # the newest committed step
    assert greedy_reward(learned.model_dir) < 0.2  # the model it started from cannot (0.06)
    # the exported one says the digit back and stops, often (after 10 steps)
    assert greedy_reward(exported) > 0.4

    # vLLM as the rollout of the Megatron trainer, both starting from the exported directory
    # (vLLM loads its weights itself); every later version goes through the channel under the
    # HF names vLLM loads. One rank (TP=1): the names and bytes SYNC sends do not depend on the
    # split (the TP=2 gathers are the runs above; `make demo-megatron-vllm` runs TP=2 into two
    # vLLM engines), and one vLLM engine starts in half the time of two on this machine.
    vllm = merged(VLLM_JOB["engine"]["vllm"], {"max_model_len": 64, "kv_cache_mb": 32.0})
    config = toml_file(
        runtime_dir,
        merged(MEGATRON_JOB, {"deadlines": VLLM_JOB["deadlines"]}),
        job={"ranks": 1, "steps": 2},
        engine={
            "rollout": "vllm",
            "megatron": {"model_dir": str(exported), "tensor_parallel_size": 1},
            "vllm": vllm,
        },
        log={"file": f"{runtime_dir}/log.jsonl"},
    )
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=600)
    assert done.returncode == 0, done.stderr
    steps = steps_of(runtime_dir / "summary.json")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["weights_match"] and s["logprob_max_abs_diff"] < 1e-4 for s in steps)
    # its first rollout samples about as well as the trained run's last (a random model: 0.06)
    trained = learned.steps[-1]["reward_mean"]
    assert steps[0]["reward_mean"] > max(trained - 0.2, 0.25), (steps[0], trained)
    assert_nothing_left(runtime_dir)


@pytest.mark.parametrize("example", ["megatron-grpo.toml", "megatron-vllm-grpo.toml"])
def test_the_examples_load_with_a_model_made_by_model_init(
    example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the examples' paths are relative to where make runs
    with pytest.raises(ConfigError, match=r"engine\.megatron\.model_dir: runs/.* not a directory"):
        load_config(ROOT / "examples" / example, environ={})
    model_dir = Path(f"runs/{example.removesuffix('.toml')}/model")
    init_model_dir(model_dir, SHAPE, seed=0)  # what `make demo-megatron` makes
    config = load_config(ROOT / "examples" / example, environ={}).config
    assert config.engine.trainer == "megatron"
    assert config.job.ranks == 2
