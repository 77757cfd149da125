"""`timeshare run` with the FSDP trainer: real workers, gloo, end to end, as a user runs it.

Thirty steps of the digit task learn (weights_match every step); a run SIGKILLed mid-step
resumes at its committed step with the same rewards; a bad model directory is exit 2 before any
worker; the checkpoint exported with `timeshare export` loads in transformers and in vLLM, and
both engines start from it where training left off.
"""

from __future__ import annotations

import json
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
import torch
import transformers

from tests.configs import merged, toml_file
from tests.cycle.jobs import assert_nothing_left
from tests.daemon.test_run import steps_of, timeshare_run
from tests.engines.vllm.test_run import VLLM_JOB
from tests.shared_runs import shared_run
from timeshare.config import load_config
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.task import RepeatDigit
from timeshare.errors import ConfigError
from timeshare.task import digit_tokenizer
from timeshare.task.vocab import EOS

pytestmark = pytest.mark.slow

KEY = "fsdp-learned"  # of its shared run
STEPS = 30
ROOT = Path(__file__).resolve().parents[3]
# The digit task at the size examples/fsdp-grpo.toml runs (head_dim 32, as vLLM's CPU attention
# needs), on two ranks.
SHAPE = ModelShape(layers=2, hidden=192, intermediate=384, heads=6, kv_heads=6, vocab=16)
FSDP_JOB: dict[str, Any] = {
    "job": {"ranks": 2, "steps": STEPS},
    "deadlines": {"phase_s": 60.0, "stall_s": 20.0, "barrier_s": 30.0, "ready_s": 120.0},
    "transfer": {"bucket_mb": 1.0, "checksum": True},
    "engine": {
        "trainer": "fsdp",
        "rollout": "torch_ref",
        "task": {"prompts_per_rank": 16, "group_size": 16, "max_completion_tokens": 6},
        "fsdp": {"micro_batch_size": 64},
    },
}


def write_config(root: Path, model_dir: Path, steps: int, **sections: Any) -> Path:
    return toml_file(
        root,
        FSDP_JOB,
        job={"steps": steps},
        engine=merged({"fsdp": {"model_dir": str(model_dir)}}, sections.pop("engine", {})),
        log={"file": f"{root}/log.jsonl"},
        **sections,
    )


@dataclass(frozen=True)
class Learned:
    """One uninterrupted run of STEPS steps, shared by the tests that read it."""

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


def test_thirty_steps_learn_the_task_with_the_weights_matching_every_step(
    learned: Learned,
) -> None:
    assert learned.done.returncode == 0, learned.done.stderr
    steps = learned.steps
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for entry in steps:
        assert entry["weights_match"] and entry["ranks_agree"], entry
        assert entry["logprob_max_abs_diff"] < 1e-4
        assert entry["committed_step"] == entry["step"]
        assert entry["sync"]["bytes"] > 0
    rewards = [s["reward_mean"] for s in steps]
    assert max(rewards[-5:]) - rewards[0] >= 0.3, rewards
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
    committed = runtime_dir / "checkpoints" / "fsdp" / "step-00000003"
    deadline = time.monotonic() + 180
    while not all((committed / f"rank{r}.pt").exists() for r in (0, 1)):
        assert first.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "step 3 was never committed"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert [s["step"] for s in steps_of(summary)] == [1, 2]
    # What a kill in the middle of step 4's checkpoint leaves: DCP's files and rank 0's part,
    # rank 1's never written. Not committed: the run resumes at 3 and writes step 4 anew.
    partial = runtime_dir / "checkpoints" / "fsdp" / "step-00000004"
    shutil.copytree(committed, partial)
    (partial / "rank1.pt").unlink()

    done = timeshare_run(write_config(runtime_dir, learned.model_dir, 5), summary)
    assert done.returncode == 0, done.stderr
    assert "(2 steps this run)" in done.stdout  # resumed at the committed step 3
    steps = steps_of(summary)
    assert [(s["step"], s["reward_mean"]) for s in steps] == expected
    assert [s["step"] for s in steps if s["resumed"]] == [3]
    assert all(s["weights_match"] for s in steps)
    assert (partial / "rank1.pt").exists()  # step 4 was redone whole
    assert_nothing_left(runtime_dir)


def test_a_job_on_fewer_ranks_resumes_resharded_where_min_nodes_allows(
    learned: Learned, runtime_dir: Path
) -> None:
    """The learned run's checkpoint (2 ranks) on one rank: refused while [cluster] min_nodes is
    unset; with it, DCP reshards the model and AdamW and the job goes on from step 30."""
    assert learned.done.returncode == 0, learned.done.stderr
    shutil.copytree(learned.root / "checkpoints", runtime_dir / "checkpoints")
    summary = runtime_dir / "summary.json"

    def config(**cluster: int) -> Path:
        sections = {"model_dir": str(learned.model_dir)}
        return toml_file(
            runtime_dir,
            FSDP_JOB,
            job={"steps": STEPS + 1, "ranks": 1},
            engine={"fsdp": sections},
            log={"file": f"{runtime_dir}/log.jsonl"},
            cluster=cluster,
        )

    refused = timeshare_run(config(), summary)
    assert refused.returncode == 1
    assert "written by 2 ranks; this job has 1: set [cluster] min_nodes" in refused.stderr

    done = timeshare_run(config(min_nodes=1), summary)
    assert done.returncode == 0, done.stderr
    steps = steps_of(summary)
    assert [(s["step"], s["resumed"], s["weights_match"]) for s in steps] == [
        (STEPS, True, True),
        (STEPS + 1, False, True),
    ]
    events = [json.loads(line) for line in (runtime_dir / "log.jsonl").read_text().splitlines()]
    resharded = [e for e in events if e["event"] == "trainer.checkpoint.resharded"]
    assert [(e["written_by_ranks"], e["ranks"], e["step"]) for e in resharded] == [(2, 1, STEPS)]
    assert_nothing_left(runtime_dir)


def test_a_bad_model_dir_is_exit_2_before_any_worker(runtime_dir: Path) -> None:
    model_dir = runtime_dir / "model"
    model_dir.mkdir()
    digit_tokenizer.save(model_dir)  # (a tokenizer: the check reaches the config)
    (model_dir / "config.json").write_text('{"model_type": "frobnicator"}')
    done = timeshare_run(write_config(runtime_dir, model_dir, 2), runtime_dir / "s.json", 120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"engine.fsdp.model_dir: {model_dir}/config.json" in done.stderr
    assert "frobnicator" in done.stderr
    assert not (runtime_dir / "run").exists()  # no worker, not even a runtime directory


def greedy_reward(model_dir: Path, prompts: int = 32) -> float:
    """The mean reward of greedy completions of the digit task by the model in `model_dir`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    task = RepeatDigit()
    rewards = []
    with torch.no_grad():
        for prompt in task.prompts(seed=99, rank=0, step=0, count=prompts):
            tokens = torch.tensor([prompt])
            for _ in range(6):
                logits = model(input_ids=tokens).logits[:, -1]
                tokens = torch.cat((tokens, logits.argmax(-1, keepdim=True)), dim=1)
                if int(tokens[0, -1]) == EOS:  # a completion ends at its EOS, as a rollout's
                    break
            rewards.append(task.reward(prompt, tuple(tokens[0, len(prompt) :].tolist())))
    return sum(rewards) / len(rewards)


def test_the_exported_checkpoint_is_the_trained_model_for_transformers_and_vllm(
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
    assert greedy_reward(exported) > 0.6  # the exported one says the digit back and stops

    # The configuration most RL users run: FSDP trainer, vLLM rollout, both starting from the
    # exported directory (vLLM loads its weights itself). Its first rollout is already good.
    vllm = merged(VLLM_JOB["engine"]["vllm"], {"max_model_len": 64, "kv_cache_mb": 32.0})
    config = toml_file(
        runtime_dir,
        merged(FSDP_JOB, {"deadlines": VLLM_JOB["deadlines"]}),
        job={"ranks": 1, "steps": 2},
        engine={"rollout": "vllm", "fsdp": {"model_dir": str(exported)}, "vllm": vllm},
        log={"file": f"{runtime_dir}/log.jsonl"},
    )
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=600)
    assert done.returncode == 0, done.stderr
    steps = steps_of(runtime_dir / "summary.json")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["weights_match"] and s["logprob_max_abs_diff"] < 1e-4 for s in steps)
    # its first rollout samples about as well as the trained run's last (a random model: 0.06)
    trained = learned.steps[-1]["reward_mean"]
    assert steps[0]["reward_mean"] > max(trained - 0.2, 0.5), (steps[0], trained)
    assert_nothing_left(runtime_dir)


@pytest.mark.parametrize("example", ["fsdp-grpo.toml", "fsdp-vllm-grpo.toml"])
def test_the_examples_load_with_a_model_made_by_model_init(
    example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the examples' paths are relative to where make runs
    with pytest.raises(ConfigError, match=r"engine\.fsdp\.model_dir: runs/.* is not a directory"):
        load_config(ROOT / "examples" / example, environ={})
    model_dir = Path(f"runs/{example.removesuffix('.toml')}/model")
    init_model_dir(model_dir, SHAPE, seed=0)  # what `make demo-fsdp` makes
    config = load_config(ROOT / "examples" / example, environ={}).config
    assert config.engine.trainer == "fsdp"
    assert config.job.ranks == 2
