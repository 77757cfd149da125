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

`Scorer.submit` hands a batch to the pool's own thread and returns at once: the rollout worker
generates the next batch (a tensor-parallel group's next rank, the validation prompts) while
the pool scores this one; batches are scored in turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from timeshare.errors import RewardFailed
from timeshare.task.reward_function import RewardCall, RewardOutcome, RewardSpec
from timeshare.task.reward_pool import RewardPool

REWARD_ERRORS = "reward_errors.jsonl"
EXCERPT_CHARS = 400


@dataclass(frozen=True)
class PendingScores:
    """A batch the pool's thread scores; `result` waits for it, within `bound_s`."""

    future: Future[list[RewardOutcome]]
    bound_s: float
    where: str

    def result(self) -> list[RewardOutcome]:
        try:
            return self.future.result(timeout=self.bound_s)
        except TimeoutError as exc:
            raise RewardFailed(
                f"the reward function {self.where}: a batch was not scored within "
                f"{self.bound_s:.0f} s, though each call has its deadline"
            ) from exc


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
        # One thread drives the pool for `submit`: a batch is scored while the worker's
        # engine generates the next (a tensor-parallel group's next rank, the validation).
        self.driver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-scoring")
        self.queued = 0  # calls submitted and not yet scored

    def bound_s(self, calls: int, queued: int = 0) -> float:
        """The longest `calls` can take to score, `queued` calls ahead of them: each call its
        `timeout_s`, and a fresh process started after each (what a timeout costs), the pool's
        processes at work side by side. A wait on them past it is a bug of the pool's."""
        rounds = -(-(calls + queued) // self.spec.processes) + 1
        return rounds * (self.spec.timeout_s + self.pool.start_timeout_s)

    def submit(
        self, calls: Sequence[RewardCall], progress: Callable[[], None] | None = None
    ) -> PendingScores:
        """`score(calls, progress)`, run by the pool's thread: batches are scored in turn."""
        bound_s = self.bound_s(len(calls), self.queued)
        self.queued += len(calls)
        future = self.driver.submit(self.score, calls, progress)
        future.add_done_callback(lambda _: self._done(len(calls)))
        return PendingScores(future, bound_s, self.spec.where)

    def _done(self, calls: int) -> None:
        self.queued -= calls

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
        """Waits for the batch being scored (its calls have deadlines), then stops the pool."""
        try:
            self.driver.shutdown(wait=True, cancel_futures=True)
        finally:
            self.pool.close()
