"""A dataset's prompts as a job uses them (timeshare/task/prompts.py, engines/task.py's
DatasetWorkload): each step's rows a function of (seed, step, rank) alone, so that a resumed run
sees exactly the prompts it would have seen; a row that does not tokenize named; the data's
fingerprint following files, keys and template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from timeshare.engines.spec import TaskSpec
from timeshare.engines.task import DatasetWorkload
from timeshare.errors import ConfigError
from timeshare.task.dataset import PromptRows
from timeshare.task.prompts import DatasetPrompts, data_fingerprint, scan
from timeshare.task.reward_function import RewardSpec
from timeshare.task.tokenizer import digit_task_tokenizer

ROWS = 24


def write_rows(path: Path, rows: int = ROWS, prompt: object = None) -> Path:
    with path.open("w") as out:
        for i in range(rows):
            text = " ".join(str((i + k) % 10) for k in range(1 + i % 3))
            said = (
                prompt
                if prompt is not None and i == rows - 1
                else [{"role": "user", "content": text}]
            )
            out.write(json.dumps({"prompt": said, "answer": text[-1]}) + "\n")
    return path


def task(tmp_path: Path, **values: object) -> TaskSpec:
    (tmp_path / "rewards.py").write_text("def score(completion, label):\n    return 1.0\n")
    reward = RewardSpec(path=str(tmp_path / "rewards.py"), name="score", processes=1)
    return TaskSpec(
        kind="dataset",
        train_files=(str(write_rows(tmp_path / "train.jsonl")),),
        label_key="answer",
        prompts_per_rank=4,
        group_size=2,
        reward=reward,
        **values,  # type: ignore[arg-type]
    )


def step_prompts(workload: DatasetWorkload, rank: int, step: int) -> list[tuple[int, ...]]:
    return [r.prompt_tokens for r in workload.requests(rank, step)]


def test_each_steps_prompts_are_a_function_of_seed_step_and_rank(tmp_path: Path) -> None:
    """Two workloads built apart (a run and its resume) deal the same rows; ranks deal
    disjoint rows within an epoch; each row is dealt once an epoch."""
    spec = task(tmp_path)
    tokenizer = digit_task_tokenizer()
    first = DatasetWorkload(spec, tokenizer, ranks=2)
    resumed = DatasetWorkload(spec, tokenizer, ranks=2)
    try:
        for step in (0, 1, 5):
            for rank in (0, 1):
                assert step_prompts(first, rank, step) == step_prompts(resumed, rank, step)
        assert step_prompts(first, 0, 1) != step_prompts(first, 0, 2)
        epoch = [
            request.request_id
            for step in range(3)  # 3 steps x 2 ranks x 4 rows: one epoch of 24
            for rank in (0, 1)
            for request in first.requests(rank, step)
        ]
        rows = {first.pending[i][0].index for i in epoch}
        assert rows == set(range(ROWS))
    finally:
        first.close()
        resumed.close()


def test_a_row_that_does_not_tokenize_is_named(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "bad.jsonl", prompt="<bos>7")  # a BOS written, one added
    with (
        PromptRows.open([path], prompt_key="prompt") as rows,
        pytest.raises(ConfigError, match=rf"train_files: row {ROWS - 1}: .*BOS twice"),
    ):
        scan(rows, digit_task_tokenizer(), 8, where="engine.task.train_files")


def test_overlong_rows_are_an_error_or_left_out(tmp_path: Path) -> None:
    tokenizer = digit_task_tokenizer()
    with PromptRows.open([write_rows(tmp_path / "t.jsonl")], prompt_key="prompt") as rows:
        found = scan(rows, tokenizer, 4, where="w")  # BOS, 3 digits, SEP: 5 tokens
        assert found.overlong.tolist() == list(range(2, ROWS, 3))
        with pytest.raises(ConfigError, match=r"w: 8 of 24 prompts are longer .* row 2 \(5"):
            DatasetPrompts.of(rows, tokenizer, found, drop=False, where="w")
        kept = DatasetPrompts.of(rows, tokenizer, found, drop=True, where="w")
        assert kept.dropped == 8 and len(kept) == 16
        dealt = kept.step_rows(0, 1, 0, 1, 16, shuffle=True)
        assert all(len(ids) <= 4 for _, ids in dealt)


def test_the_fingerprint_follows_the_files_and_the_keys(tmp_path: Path) -> None:
    tokenizer = digit_task_tokenizer()
    path = write_rows(tmp_path / "t.jsonl")
    with PromptRows.open([path], prompt_key="prompt") as rows:
        before = data_fingerprint(rows, tokenizer)
    with PromptRows.open([path], prompt_key="prompt", label_key="answer") as rows:
        assert data_fingerprint(rows, tokenizer) != before
    path.write_text(path.read_text().replace('"1', '"2', 1))
    with PromptRows.open([path], prompt_key="prompt") as rows:
        assert data_fingerprint(rows, tokenizer) != before


def test_a_scan_is_kept_under_the_datas_fingerprint_and_read_back(tmp_path: Path) -> None:
    """The check at `timeshare run` scans a large file once; the rollout workers read the
    lengths it kept. Other data (a byte changed) is scanned anew."""
    tokenizer = digit_task_tokenizer()
    path = write_rows(tmp_path / "t.jsonl")
    kept_in = tmp_path / "lengths"
    with PromptRows.open([path], prompt_key="prompt") as rows:
        first = scan(rows, tokenizer, 8, where="w", kept_in=kept_in)
        (kept,) = kept_in.iterdir()
        assert kept.name == f"{data_fingerprint(rows, tokenizer)}.npy"
        calls: list[int] = []
        again = scan(rows, tokenizer, 8, where="w", kept_in=kept_in, progress=calls.append)
        assert calls == []  # read back, not scanned
        assert again.lengths.tolist() == first.lengths.tolist()
    path.write_text(path.read_text().replace('"content": "0"', '"content": "0 0"', 1))
    with PromptRows.open([path], prompt_key="prompt") as rows:
        changed = scan(rows, tokenizer, 8, where="w", kept_in=kept_in)
    assert len(list(kept_in.iterdir())) == 2
    assert changed.lengths.tolist() != first.lengths.tolist()


def test_every_request_of_a_dataset_carries_the_stop_set_with_the_models_eos(
    tmp_path: Path,
) -> None:
    """vLLM runs with ignore_eos=True and stops at the request's stop set alone: every train
    and validation request must carry the tokenizer's EOS and the job's own stop ids."""
    val = write_rows(tmp_path / "val.jsonl", rows=4)
    spec = task(tmp_path, val_files=(str(val),), val_every=1, stop_token_ids=(3,))
    tokenizer = digit_task_tokenizer()
    workload = DatasetWorkload(spec, tokenizer, ranks=1)
    try:
        requests = workload.requests(0, 1) + workload.validation(0, 1)
        assert len(requests) == 4 * 2 + 4
        for request in requests:
            assert tokenizer.eos_id in request.sampling.stop_token_ids
            assert 3 in request.sampling.stop_token_ids
    finally:
        workload.close()
