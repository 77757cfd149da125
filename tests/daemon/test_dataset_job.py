"""A user's own job through `timeshare task check` and `timeshare run`: a file of prompts, a
reward function of theirs, checked before anything starts; a failing reward ends the run by name
(never a silent 0) and a fixed restart goes on with the same prompts; a skipped sample is
counted; a resume over other data is refused. Real processes: the CLI, the workers, the reward
pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.configs import TINY, toml_file
from tests.cycle.jobs import assert_nothing_left
from tests.daemon.test_run import steps_of

RUN_TIMEOUT_S = 200.0


def write_rows(path: Path, rows: int = 40) -> Path:
    """Chat prompts of two or three digits (the digit task's tokenizer reads digits only),
    labelled with their last digit."""
    prompts, answers = [], []
    for i in range(rows):
        digits = [str((i * 7 + k * 3) % 10) for k in range(2 + i % 2)]
        prompts.append([{"role": "user", "content": " ".join(digits)}])
        answers.append(digits[-1])
    table = pa.table({"prompt": prompts, "answer": answers, "data_source": ["digits"] * rows})
    pq.write_table(table, path, row_group_size=16)
    return path


REWARD = """
def compute_score(completion, label, step):
    {body}
    return float(completion.split()[:1] == [label])
"""


def dataset_job(root: Path, reward_body: str = "pass", **task: Any) -> Path:
    """TINY's engines on one rank, serving `root`/train.parquet scored by `root`/rewards.py."""
    data = write_rows(root / "train.parquet")
    (root / "rewards.py").write_text(REWARD.format(body=reward_body))
    reward = {"path": str(root / "rewards.py"), "timeout_s": 20.0, **task.pop("reward", {})}
    return toml_file(
        root,
        TINY,
        job={"ranks": 1, "steps": 3},
        engine={
            "task": {
                "kind": "dataset",
                "train_files": [str(data)],
                "label_key": "answer",
                "max_prompt_tokens": 8,
                "reward": reward,
                **task,
            }
        },
        log={"file": f"{root}/log.jsonl", "samples_per_step": 4},
    )


def timeshare(*args: str, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeshare", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_task_check_reports_every_row_the_stop_set_prompts_and_the_reward(
    tmp_path: Path,
) -> None:
    checked = timeshare("task", "check", str(dataset_job(tmp_path)))
    assert checked.returncode == 0, checked.stderr
    said = checked.stdout
    assert "engine.task.train_files: 40 rows" in said
    assert "p50 5" in said and "max 5" in said  # BOS, two or three digits, SEP
    assert "stop set: [12]" in said
    assert said.count("prompt of row") == 2
    assert "with the label: 1.0" in said and "with an empty completion: 0.0" in said
    assert "task check: ok" in said


def test_overlong_rows_are_listed_and_exit_2_or_dropped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "error").mkdir()
    refused = timeshare("task", "check", str(dataset_job(tmp_path / "error", max_prompt_tokens=4)))
    assert refused.returncode == 2
    # rows of three digits are 5 tokens: every odd row
    assert "20 of 40 prompts are longer than engine.task.max_prompt_tokens (4)" in refused.stderr
    assert "row 1 (5 tokens)" in refused.stderr and 'overlong = "drop"' in refused.stderr
    (tmp_path / "drop").mkdir()
    config = dataset_job(tmp_path / "drop", max_prompt_tokens=4, overlong="drop")
    dropped = timeshare("task", "check", str(config))
    assert dropped.returncode == 0, dropped.stderr
    assert "20 overlong rows dropped" in dropped.stdout


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("raise KeyError('no such column')", "KeyError"),
        ("return 'yes'", "str"),
    ],
)
def test_a_reward_that_fails_at_check_is_exit_2_naming_it(
    tmp_path: Path, body: str, said: str
) -> None:
    checked = timeshare("task", "check", str(dataset_job(tmp_path, body)))
    assert checked.returncode == 2
    assert "rewards.py:compute_score" in checked.stderr and said in checked.stderr


@pytest.mark.slow
def test_a_raising_reward_ends_the_run_by_name_and_a_fixed_restart_sees_the_same_prompts(
    tmp_path: Path,
) -> None:
    """on_error = "fail": the ROLLOUT of step 2 raises; the run ends (exit 1) naming the
    function, the sample and its row, with its TRAIN committed and every failure in
    reward_errors.jsonl; fixed, the restart goes on from step 2 with the same rows."""
    config = dataset_job(tmp_path, "if step == 2: raise ValueError('bad label')")
    summary = tmp_path / "summary.json"
    failed = timeshare("run", str(config), "--summary", str(summary))
    assert failed.returncode == 1, failed.stderr
    assert "rewards.py:compute_score failed on sample s2-r0-p0-g0 (row " in failed.stderr
    assert "ValueError: bad label" in failed.stderr
    errors = jsonl(tmp_path / "reward_errors.jsonl")
    assert {e["step"] for e in errors} == {2}
    assert "Traceback" in errors[0]["error"] and "bad label" in errors[0]["error"]
    assert [s["step"] for s in steps_of(summary)] == [1]  # (step 2's ROLLOUT did not end)
    rows_failed = {e["sample_id"]: e["row_index"] for e in errors}

    (tmp_path / "rewards.py").write_text(REWARD.format(body="pass"))
    resumed = timeshare("run", str(config), "--summary", str(summary))
    assert resumed.returncode == 0, resumed.stderr
    assert [s["step"] for s in steps_of(summary)] == [1, 2, 3]
    after = [s for s in jsonl(tmp_path / "samples.jsonl") if s["step"] == 2]
    assert after and all(rows_failed[s["sample_id"]] == s["row_index"] for s in after)
    assert all(s["reward"] in (0.0, 1.0) for s in after)
    assert_nothing_left(tmp_path / "run")


@pytest.mark.slow
def test_skipped_samples_are_counted_validation_is_scored_and_samples_shown(
    tmp_path: Path,
) -> None:
    """on_error = "skip": a sample whose reward raised (or returned None) is out of the loss,
    counted in the step's figures; the run goes on. Every `val_every` steps the validation
    prompts are scored, never trained on; `timeshare report --samples` shows the last ones."""
    body = "if completion.startswith('1'): return None\n    if completion.startswith('2'): 1 / 0"
    val = write_rows(tmp_path / "val.parquet", rows=6)
    config = dataset_job(
        tmp_path,
        body,
        reward={"on_error": "skip", "max_skipped_fraction": 1.0},
        val_files=[str(val)],
        val_every=2,
    )
    summary = tmp_path / "summary.json"
    done = timeshare("run", str(config), "--summary", str(summary))
    assert done.returncode == 0, done.stderr
    steps = steps_of(summary)
    assert len(steps) == 3
    # the validation of step 2 only, scored (0 or 1 each, skips left out)
    assert [s["val_reward_mean"] is not None for s in steps] == [False, True, False]
    assert 0.0 <= steps[1]["val_reward_mean"] <= 1.0
    assert "val_reward" in done.stdout
    shown = timeshare("report", str(tmp_path), "--samples", "2")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("--- completion") == 2 and "step 3" in shown.stdout
    skipped = [s["rewards"]["skipped_fraction"] for s in steps]
    assert any(f > 0 for f in skipped), skipped
    assert all(0.0 <= f < 1.0 for f in skipped)
    errors = jsonl(tmp_path / "reward_errors.jsonl")
    assert errors and all("ZeroDivisionError" in e["error"] for e in errors)
    assert_nothing_left(tmp_path / "run")


@pytest.mark.slow
def test_a_resume_over_changed_data_is_refused_by_name_unless_data_changed(
    tmp_path: Path,
) -> None:
    """The fingerprint of the data the checkpoints learnt from is kept beside them; other data
    is exit 2 before any worker starts."""
    config = dataset_job(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "rank0").mkdir(parents=True)  # (a checkpoint of an earlier run)
    (checkpoints / "data.json").write_text(json.dumps({"fingerprint": "0" * 32, "files": []}))
    summary = str(tmp_path / "summary.json")
    refused = timeshare("run", str(config), "--steps", "1", "--summary", summary)
    assert refused.returncode == 2
    assert "differ from those the checkpoints" in refused.stderr
    assert "--data-changed" in refused.stderr
    assert json.loads((checkpoints / "data.json").read_text())["fingerprint"] == "0" * 32
    assert not (tmp_path / "summary.json").exists()

    allowed = timeshare("run", str(config), "--steps", "1", "--summary", summary, "--data-changed")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads((checkpoints / "data.json").read_text())["fingerprint"] != "0" * 32


@pytest.mark.slow
def test_the_text_example_runs_as_make_demo_text_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/text/: its data made by its script, the model by `timeshare model init`, the
    check and two steps of the run on one rank (`make demo-text` runs forty on two, learning
    from 0.01 to 0.5)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # the example's paths are relative to where make runs
    made = subprocess.run(
        [sys.executable, str(root / "examples/text/make_data.py"), "runs/text-grpo/data"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    shape = ["--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "2"]
    assert timeshare("model", "init", *shape, "runs/text-grpo/model").returncode == 0
    (tmp_path / "examples/text").mkdir(parents=True)
    (tmp_path / "examples/text/rewards.py").write_text(
        (root / "examples/text/rewards.py").read_text()
    )
    config = str(root / "examples/text/text-grpo.toml")
    checked = timeshare("task", "check", config)
    assert checked.returncode == 0, checked.stderr
    assert "engine.task.train_files: 2000 rows" in checked.stdout
    monkeypatch.setenv("TIMESHARE_JOB__RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TIMESHARE_ENGINE__TASK__VAL_EVERY", "2")
    summary = "runs/text-grpo/summary.json"
    done = timeshare("run", config, "--steps", "2", "--ranks", "1", "--summary", summary)
    assert done.returncode == 0, done.stderr
    steps = steps_of(Path("runs/text-grpo/summary.json"))
    assert [s["weights_match"] for s in steps] == [True, True]
    assert len(steps[0]["per_rank"]) == 1
    assert steps[1]["val_reward_mean"] is not None
    assert set(steps[1]["rewards"]["extras"]) == {"right_digit", "stopped"}
    assert Path("runs/text-grpo/samples.jsonl").exists()
    assert_nothing_left(tmp_path / "run")


def test_the_gsm8k_recipe_checks_on_its_stand_in(tmp_path: Path) -> None:
    """The GPU recipe (a Qwen-class model, verl's GSM8K parquet, the math reward) passes
    `timeshare task check` here, on the stand-in its script writes for the user's parts."""
    root = Path(__file__).resolve().parents[2]
    recipe = root / "examples/recipes/gsm8k-qwen-math"
    made = subprocess.run(
        [sys.executable, str(recipe / "make_standin.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    checked = subprocess.run(
        [sys.executable, "-m", "timeshare", "task", "check", str(recipe / "job.toml")],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        cwd=root,  # (the recipe names its model directory from there)
        env={
            **os.environ,
            "TIMESHARE_ENGINE__TASK__TOKENIZER": str(tmp_path / "tokenizer"),
            "TIMESHARE_ENGINE__TASK__TRAIN_FILES": json.dumps([str(tmp_path / "train.parquet")]),
            "TIMESHARE_ENGINE__TASK__VAL_FILES": json.dumps([str(tmp_path / "test.parquet")]),
        },
    )
    assert checked.returncode == 0, checked.stderr
    said = checked.stdout
    assert "reward timeshare.rewards:math on row 0 with the label: 1.0" in said
    assert "with an empty completion: 0.0" in said
    assert "<|im_start|>assistant" in said  # Qwen's chat template, rendered


def test_a_reward_parameter_nothing_supplies_is_exit_2_naming_it(tmp_path: Path) -> None:
    config = dataset_job(tmp_path)
    (tmp_path / "rewards.py").write_text("def compute_score(completion, solution):\n    return 0\n")
    checked = timeshare("task", "check", str(config))
    assert checked.returncode == 2
    assert "nothing supplies its parameter 'solution'" in checked.stderr
    assert "answer" in checked.stderr  # a column of the data, among the names it could take
