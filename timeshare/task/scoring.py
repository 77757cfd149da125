"""Scoring a batch with the job's reward function: the pool's outcomes, and what a failure does.

A failure (the function raised, timed out, killed its process, or returned what is not a score)
is never a reward of 0: each one is written to `reward_errors.jsonl` in the run's directory
(sample, row, prompt and completion excerpts, traceback), and then

- `on_error = "fail"`: `RewardFailed` names the function, the sample and the row, and the run
  ends in ROLLOUT with every committed step kept; fixed and restarted, it goes on from there
  with the same prompts (they are a function of the step).
- `on_error = "skip"`: the sample's reward is None, which takes it out of the loss and of its
  group's mean (grpo.py), counted in the step's figures; failures past `max_skipped_fraction`
  of a batch end the run by name.

A function that returns None skips its sample on purpose: counted, never an error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from timeshare.errors import RewardFailed
from timeshare.task.reward_function import RewardCall, RewardOutcome, RewardSpec
from timeshare.task.reward_pool import RewardPool

REWARD_ERRORS = "reward_errors.jsonl"
EXCERPT_CHARS = 400


class Scorer:
    """The job's reward function in its pool of processes, with the failure rules above."""

    def __init__(
        self,
        spec: RewardSpec,
        *,
        base_dir: Path,
        run_dir: Path | None,
        columns: Iterable[str] | None = None,
    ) -> None:
        """`columns`: the dataset's, so that a parameter nothing supplies is refused when the
        pool starts (ConfigError), not at the first sample."""
        self.spec = spec
        self.errors_file = None if run_dir is None else run_dir / REWARD_ERRORS
        self.pool = RewardPool(spec, base_dir=base_dir, columns=columns)

    def score(
        self, calls: Sequence[RewardCall], progress: Callable[[], None] | None = None
    ) -> list[RewardOutcome]:
        """Each call's outcome, in order; `RewardFailed` as the rules above say."""
        outcomes = self.pool.score(calls, progress)
        failed = [(c, o) for c, o in zip(calls, outcomes, strict=True) if o.error is not None]
        if failed:
            self.record(failed)
            self.check(failed, len(calls))
        return outcomes

    def check(self, failed: list[tuple[RewardCall, RewardOutcome]], batch: int) -> None:
        call, outcome = failed[0]
        said = (outcome.error or "").strip().splitlines()[-1:] or [""]
        first = (
            f"the reward function {self.spec.where} failed on sample {call.sample_id} "
            f"(row {call.row_index}, step {call.step}): {said[0]}"
        )
        kept = f"; every failure is in {self.errors_file}" if self.errors_file else ""
        if self.spec.on_error == "fail":
            more = f" ({len(failed)} of {batch} samples failed)" if len(failed) > 1 else ""
            raise RewardFailed(f"{first}{more}{kept}")
        if len(failed) > self.spec.max_skipped_fraction * batch:
            raise RewardFailed(
                f"{len(failed)} of {batch} samples were skipped, more than "
                f"engine.task.reward.max_skipped_fraction ({self.spec.max_skipped_fraction:g}) "
                f"of the batch; first: {first}{kept}"
            )

    def record(self, failed: list[tuple[RewardCall, RewardOutcome]]) -> None:
        """Each failure as a line of reward_errors.jsonl, durable before the run goes on."""
        if self.errors_file is None:
            return
        lines = [
            json.dumps(
                {
                    "time": time.time(),
                    "function": self.spec.where,
                    "step": call.step,
                    "sample_id": call.sample_id,
                    "row_index": call.row_index,
                    "prompt": call.prompt[-EXCERPT_CHARS:],
                    "completion": call.completion[:EXCERPT_CHARS],
                    "finish_reason": call.finish_reason,
                    "error": outcome.error,
                }
            )
            for call, outcome in failed
        ]
        self.errors_file.parent.mkdir(parents=True, exist_ok=True)
        with self.errors_file.open("a") as out:
            out.write("".join(line + "\n" for line in lines))

    def close(self) -> None:
        self.pool.close()
