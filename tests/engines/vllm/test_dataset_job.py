"""A verl `compute_score` file runs unchanged with FSDP + vLLM: a user's own job end to end.

The reward file is written as verl's users write theirs (`compute_score(data_source,
solution_str, ground_truth, extra_info=None)`, a DAPO-style dict with a text "pred"); the data is
parquet with chat prompts, a `data_source` column and an `extra_info` column of dicts. `timeshare
run` checks the task, then trains with FSDP on what vLLM samples: every step's weights match,
its reward is scored, the reward's numeric extras are figures (its text is not), samples are
written, the data's fingerprint is kept beside the checkpoints, and nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.configs import merged, toml_file
from tests.cycle.jobs import assert_nothing_left, processes_of
from tests.daemon.test_run import steps_of
from tests.engines.foreign_hosts import left_in_shm, recorded_processes, shm_names
from tests.engines.fsdp.test_run import FSDP_JOB
from tests.engines.vllm.test_run import VLLM_JOB
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.runtime import wait_gone

pytestmark = pytest.mark.slow

ROWS = 40
STEPS = 2
RUN_TIMEOUT_S = 600.0
# verl's signature and return value, unchanged: timeshare binds its parameters by name.
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Right when the completion's first word is the prompt's last digit."""
    assert data_source == "last_digit", data_source
    assert isinstance(extra_info, dict) and isinstance(extra_info["index"], int), extra_info
    said = solution_str.split()
    acc = bool(said) and said[0] == ground_truth
    return {"score": 1.0 if acc else 0.0, "acc": acc, "pred": solution_str}
'''


def write_rows(path: Path) -> Path:
    """Chat prompts of two to four digits (the tokenizer `timeshare model init` writes reads
    digits only), labelled with their last digit, as verl's preprocessed parquet holds them."""
    prompts, answers = [], []
    for i in range(ROWS):
        digits = [str((i * 7 + k * 3) % 10) for k in range(2 + i % 3)]
        prompts.append([{"role": "user", "content": " ".join(digits)}])
        answers.append(digits[-1])
    table = pa.table(
        {
            "prompt": prompts,
            "answer": answers,
            "data_source": ["last_digit"] * ROWS,
            "extra_info": [{"index": i, "split": "train"} for i in range(ROWS)],
        }
    )
    pq.write_table(table, path, row_group_size=16)
    return path


def write_config(root: Path) -> Path:
    """FSDP trains the model `timeshare model init` makes (head_dim 32, as vLLM's CPU attention
    needs), vLLM samples it; one rank, a few prompts a step."""
    model_dir = init_model_dir(root / "model", ModelShape(), seed=0)
    data = write_rows(root / "train.parquet")
    (root / "rewards.py").write_text(VERL_REWARD)
    return toml_file(
        root,
        merged(FSDP_JOB, {"deadlines": VLLM_JOB["deadlines"]}),
        job={"ranks": 1, "steps": STEPS},
        engine={
            "rollout": "vllm",
            "fsdp": {"model_dir": str(model_dir), "micro_batch_size": 8},  # a minibatch: 16 / 2
            "vllm": VLLM_JOB["engine"]["vllm"],
            "task": {
                "kind": "dataset",
                "train_files": [str(data)],
                "prompt_key": "prompt",
                "label_key": "answer",
                "max_prompt_tokens": 8,
                "max_completion_tokens": 6,
                "prompts_per_rank": 4,
                "group_size": 4,
                "reward": {"path": str(root / "rewards.py"), "name": "compute_score"},
            },
        },
        log={"file": f"{root}/log.jsonl", "samples_per_step": 2},
    )


def run_watching_vllm(root: Path, config: Path) -> tuple[int, str, list[int]]:
    """`timeshare run` as a user runs it: its exit status, its stderr, and every vLLM process
    the runtime directory's records named while it ran."""
    argv = [sys.executable, "-m", "timeshare.daemon.cli", "run", str(config)]
    seen: set[int] = set()
    with (root / "stdout.txt").open("w") as out, (root / "stderr.txt").open("w") as err:
        run = subprocess.Popen(
            [*argv, "--summary", str(root / "summary.json")], stdout=out, stderr=err, cwd=root
        )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while run.poll() is None:
                assert time.monotonic() < deadline, f"the run took over {RUN_TIMEOUT_S:g} s"
                # (a record may be half written, or removed, as it is read)
                with contextlib.suppress(OSError, ValueError):
                    seen.update(recorded_processes(root / "run"))
                time.sleep(0.2)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    return run.returncode, (root / "stderr.txt").read_text(), sorted(seen)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_verl_compute_score_file_runs_unchanged_with_fsdp_and_vllm(runtime_dir: Path) -> None:
    before = shm_names()
    config = write_config(runtime_dir)
    returncode, stderr, vllm_processes = run_watching_vllm(runtime_dir, config)
    assert returncode == 0, stderr[-3000:]

    steps = steps_of(runtime_dir / "summary.json")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for step in steps:
        assert step["weights_match"], step
        assert step["reward_mean"] is not None, step
        extras = step["rewards"]["extras"]
        # verl's "acc" (a bool) is a figure; its "pred" (the completion's text) is not
        assert "acc" in extras and "pred" not in extras, extras
        assert extras["acc"] == pytest.approx(step["reward_mean"])  # score is acc, here

    # two samples of each ROLLOUT: the one before step 1 (step 0), and each step's, which
    # samples the next step's batch (the last one's included, though no step trains on it)
    samples = jsonl(runtime_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [step for step in range(STEPS + 1) for _ in (0, 1)]
    for sample in samples:
        assert isinstance(sample["completion"], str) and sample["completion_tokens"] > 0, sample
        assert sample["reward"] in (0.0, 1.0), sample
        assert sample["extras"] == {"acc": sample["reward"]}, sample

    record = json.loads((runtime_dir / "checkpoints" / "data.json").read_text())
    assert record["fingerprint"], record
    assert not (runtime_dir / "reward_errors.jsonl").exists()

    # nothing outlives the run: its workers, vLLM's EngineCore, the reward pool, shared memory
    assert vllm_processes, "no vLLM process was ever on record"
    assert wait_gone(vllm_processes, 10) == []
    assert processes_of(runtime_dir) == []
    assert_nothing_left(runtime_dir)
    assert left_in_shm(before) == []
