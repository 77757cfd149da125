"""Scoring a batch (timeshare/task/scoring.py): a batch handed to the pool's thread is scored
while the caller goes on; batches in turn; a failure never a 0, written and raised by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from timeshare.errors import RewardFailed
from timeshare.task.reward_function import RewardCall, RewardSpec
from timeshare.task.scoring import Scorer

REWARD = """
import time

def score(completion, step):
    if completion == "slow":
        time.sleep(1.0)
    if completion == "bad":
        raise ValueError("no score for this one")
    return float(step)
"""


def calls(completions: list[str], step: int) -> list[RewardCall]:
    return [
        RewardCall(sample_id=f"s{step}-{i}", row_index=i, completion=c, prompt="p", step=step)
        for i, c in enumerate(completions)
    ]


@pytest.fixture
def scorer(tmp_path: Path) -> Scorer:
    (tmp_path / "rewards.py").write_text(REWARD)
    spec = RewardSpec(path=str(tmp_path / "rewards.py"), name="score", processes=2)
    return Scorer(spec, base_dir=tmp_path, run_dir=tmp_path)


def test_a_submitted_batch_is_scored_while_the_caller_goes_on(scorer: Scorer) -> None:
    try:
        first = scorer.submit(calls(["slow", "slow"], 1))
        second = scorer.submit(calls(["x"], 2))
        assert not first.future.done()  # (its rewards sleep a second: submit did not wait)
        assert [o.score for o in first.result()] == [1.0, 1.0]
        assert [o.score for o in second.result()] == [2.0]
    finally:
        scorer.close()


def test_a_failure_is_written_and_raised_by_name_never_a_zero(
    scorer: Scorer, tmp_path: Path
) -> None:
    try:
        pending = scorer.submit(calls(["x", "bad"], 3))
        with pytest.raises(RewardFailed, match=r"rewards\.py:score failed on sample s3-1 \(row 1"):
            pending.result()
        (line,) = (tmp_path / "reward_errors.jsonl").read_text().splitlines()
        written = json.loads(line)
        assert written["sample_id"] == "s3-1" and "no score for this one" in written["error"]
        assert [o.score for o in scorer.submit(calls(["y"], 4)).result()] == [4.0]  # goes on
    finally:
        scorer.close()
