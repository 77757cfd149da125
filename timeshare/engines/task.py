"""What the rollout serves: the built-in digit task, the user's dataset, or fixed requests.

Both tasks are data read through the job's tokenizer (timeshare/task/tokenizer.py), which this
worker alone holds: a request carries the prompt's token ids only, and every engine stops at the
job's one stop set (the tokenizer's EOS, the generation config's, `[engine.task]
stop_token_ids`). The prompts of a step are a function of (seed, rank, step) alone, which makes
the data position a step number: a run resumed from step k sees exactly the prompts it would
have seen.

- `DigitWorkload`: the digit task (timeshare/task/digits.py), scored in this process.
- `DatasetWorkload`: the rows of `train_files` (timeshare/task/prompts.py), scored by the
  user's reward function in its pool of processes (timeshare/task/scoring.py); validation
  prompts from `val_files` every `val_every` steps.
- `FixedWorkload`: the simulated engines' requests, scored by nobody.

Each writes the first `[log] samples_per_step` samples of a step, as text, to samples.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from timeshare.engines.base import RolloutRequest, RolloutSample, SamplingParams
from timeshare.engines.registry import Family
from timeshare.engines.spec import TaskSpec
from timeshare.errors import ConfigError
from timeshare.task import tokenizer as tokenizers
from timeshare.task.dataset import PromptRows, Row
from timeshare.task.digits import RepeatDigit
from timeshare.task.prompts import PROMPT_LENGTHS, DatasetPrompts, prompt_text, scan
from timeshare.task.reward_function import RewardCall
from timeshare.task.scoring import PendingScores, Scorer
from timeshare.task.seeds import mix
from timeshare.task.tokenizer import TaskTokenizer

if TYPE_CHECKING:
    from timeshare.engines.spec import EngineChoice

__all__ = [
    "DatasetWorkload",
    "DigitWorkload",
    "FixedWorkload",
    "RepeatDigit",
    "Workload",
    "mix",
    "sampling_seed",
    "workload",
]

FIXED_REQUESTS = 4
SAMPLES = "samples.jsonl"
Progress = Callable[[], None]


class Workload(Protocol):
    def requests(self, rank: int, step: int) -> list[RolloutRequest]: ...

    def scoring(
        self,
        rank: int,
        step: int,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        progress: Progress,
    ) -> Scoring:
        """`samples` (of rank `rank`'s `requests`) being scored, perhaps while the engine
        generates the next batch; the result writes the first ones as text (samples.jsonl)."""
        ...

    def scored(
        self,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        step: int,
        progress: Progress,
    ) -> list[RolloutSample]:
        """`samples` (of `requests`) with their rewards (None: skipped), now."""
        ...

    def validation(self, rank: int, step: int) -> list[RolloutRequest]:
        """Rank `rank`'s validation prompts at `step` ([] when it does not validate)."""
        ...

    def close(self) -> None: ...


class Scoring(Protocol):
    def result(self) -> list[RolloutSample]:
        """The samples with their rewards, once scored (raises what scoring raised)."""
        ...


@dataclass(frozen=True)
class Scored:
    """Scoring done at once (the digit task's reward is a comparison)."""

    samples: list[RolloutSample]

    def result(self) -> list[RolloutSample]:
        return self.samples


@dataclass(frozen=True)
class ScoringInPool:
    """A batch the reward pool is scoring: its outcomes become the samples' rewards."""

    outcomes: PendingScores
    samples: list[RolloutSample]
    written: Callable[[list[RolloutSample]], None]

    def result(self) -> list[RolloutSample]:
        scored = [
            dataclasses.replace(sample, reward=outcome.score, reward_extras=dict(outcome.extras))
            for sample, outcome in zip(self.samples, self.outcomes.result(), strict=True)
        ]
        self.written(scored)
        return scored


def sampling_seed(seed: int, rank: int, step: int) -> int:
    return mix(seed, rank, step, 2)


def sampling_of(spec: TaskSpec, tokenizer: TaskTokenizer, seed: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=spec.max_completion_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        seed=seed,
        stop_token_ids=tokenizer.stop_set(spec.stop_token_ids),
    )


@dataclass(frozen=True)
class SamplesLog:
    """samples.jsonl: the first `per_step` samples of each step and rank, as text."""

    path: Path | None
    per_step: int

    def write(self, lines: Sequence[dict[str, object]]) -> None:
        if self.path is None or not self.per_step or not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write("".join(json.dumps(line) + "\n" for line in lines[: self.per_step]))


def sample_line(
    tokenizer: TaskTokenizer, step: int, rank: int, sample: RolloutSample, prompt: str
) -> dict[str, object]:
    return {
        "step": step,
        "rank": rank,
        "sample_id": sample.request_id,
        "prompt": prompt,
        "completion": tokenizer.decode(sample.tokens, skip_special_tokens=False),
        "reward": sample.reward,
        "extras": sample.reward_extras,
        "finish_reason": sample.finish_reason,
        "completion_tokens": len(sample.tokens),
    }


@dataclass(frozen=True)
class DigitWorkload:
    """The digit task: each prompt `group_size` times, seeded by (seed, rank, step), its
    prompts through `tokenizer` (the digit task's own unless given)."""

    spec: TaskSpec
    tokenizer: TaskTokenizer = field(default_factory=tokenizers.digit_task_tokenizer)
    samples_log: SamplesLog = SamplesLog(None, 0)
    task: RepeatDigit = field(init=False, repr=False)

    def __post_init__(self) -> None:
        task = RepeatDigit(self.tokenizer)
        longest = task.longest_prompt()
        if longest > self.spec.max_prompt_tokens:
            raise ConfigError(
                f"engine.task.max_prompt_tokens ({self.spec.max_prompt_tokens}) is shorter than "
                f"the task's longest prompt ({longest} tokens through {self.tokenizer.where})"
            )
        object.__setattr__(self, "task", task)

    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        sampling = sampling_of(self.spec, self.tokenizer, sampling_seed(self.spec.seed, rank, step))
        prompts = self.task.prompts(self.spec.seed, rank, step, self.spec.prompts_per_rank)
        return [
            RolloutRequest(f"s{step}-r{rank}-p{p}-g{g}", prompt, sampling)
            for p, prompt in enumerate(prompts)
            for g in range(self.spec.group_size)
        ]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return self.task.reward(request.prompt_tokens, sample.tokens)

    def scored(
        self,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        step: int,
        progress: Progress,
    ) -> list[RolloutSample]:
        return [
            dataclasses.replace(sample, reward=self.score(request, sample))
            for request, sample in zip(requests, samples, strict=True)
        ]

    def scoring(
        self,
        rank: int,
        step: int,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        progress: Progress,
    ) -> Scoring:
        scored = self.scored(requests, samples, step, progress)
        self.record(step, rank, requests, scored)
        return Scored(scored)

    def validation(self, rank: int, step: int) -> list[RolloutRequest]:
        return []

    def record(
        self, step: int, rank: int, requests: list[RolloutRequest], samples: list[RolloutSample]
    ) -> None:
        self.samples_log.write(
            [
                sample_line(
                    self.tokenizer,
                    step,
                    rank,
                    s,
                    self.tokenizer.decode(r.prompt_tokens, skip_special_tokens=False),
                )
                for r, s in zip(requests[: self.samples_log.per_step], samples, strict=False)
            ]
        )

    def close(self) -> None:
        """Nothing held."""


# The digit task's old name (tests and benchmarks build it by this one).
TaskWorkload = DigitWorkload


class DatasetWorkload:
    """The user's task: rows of `train_files` as prompts, each `group_size` times, scored by
    the user's reward function; `val_files` every `val_every` steps."""

    def __init__(
        self,
        spec: TaskSpec,
        tokenizer: TaskTokenizer,
        *,
        ranks: int,
        run_dir: Path | None = None,
        samples_per_step: int = 0,
        base_dir: Path = Path(),
    ) -> None:
        assert spec.reward is not None, "a dataset task has a reward (TaskSpec's check)"
        self.spec = spec
        self.tokenizer = tokenizer
        self.ranks = ranks
        self.run_dir = run_dir
        self.samples_log = SamplesLog(
            None if run_dir is None else run_dir / SAMPLES, samples_per_step
        )
        self.train = self._prompts(spec.train_files, "engine.task.train_files")
        self.val = (
            self._prompts(spec.val_files, "engine.task.val_files") if spec.val_files else None
        )
        ((first, _),) = self.train.share(0, 1, 1)
        self.scorer = Scorer(spec.reward, base_dir=base_dir, run_dir=run_dir, columns=first.columns)
        # the rows of the requests handed out and not yet scored, by request id
        self.pending: dict[str, tuple[Row, str]] = {}

    def _prompts(self, files: Sequence[str], where: str) -> DatasetPrompts:
        rows = PromptRows.open(
            files, prompt_key=self.spec.prompt_key, label_key=self.spec.label_key, where=where
        )
        # (the lengths the check at `timeshare run` kept: no second scan of a large file)
        kept_in = None if self.run_dir is None else self.run_dir / PROMPT_LENGTHS
        found = scan(
            rows, self.tokenizer, self.spec.max_prompt_tokens, where=where, kept_in=kept_in
        )
        return DatasetPrompts.of(
            rows, self.tokenizer, found, drop=self.spec.overlong == "drop", where=where
        )

    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        sampling = sampling_of(self.spec, self.tokenizer, sampling_seed(self.spec.seed, rank, step))
        rows = self.train.step_rows(
            self.spec.seed,
            step,
            rank,
            self.ranks,
            self.spec.prompts_per_rank,
            shuffle=self.spec.shuffle,
        )
        return self._requests(f"s{step}-r{rank}", rows, sampling, self.spec.group_size)

    def validation(self, rank: int, step: int) -> list[RolloutRequest]:
        if self.val is None or not self.spec.val_every or step % self.spec.val_every:
            return []
        sampling = dataclasses.replace(
            sampling_of(self.spec, self.tokenizer, sampling_seed(self.spec.seed, rank, -step)),
            temperature=self.spec.val_temperature,
            top_p=1.0,
        )
        rows = self.val.share(rank, self.ranks, self.spec.val_prompts)
        return self._requests(f"val{step}-r{rank}", rows, sampling, 1)

    def _requests(
        self,
        name: str,
        rows: list[tuple[Row, tuple[int, ...]]],
        sampling: SamplingParams,
        group: int,
    ) -> list[RolloutRequest]:
        requests = []
        for p, (row, ids) in enumerate(rows):
            text = prompt_text(row, self.tokenizer)
            for g in range(group):
                request = RolloutRequest(f"{name}-p{p}-g{g}", ids, sampling)
                self.pending[request.request_id] = (row, text)
                requests.append(request)
        return requests

    def scoring(
        self,
        rank: int,
        step: int,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        progress: Progress,
    ) -> Scoring:
        """Scored in the pool while this worker goes on (the engine's next batch)."""
        calls = self._calls(requests, samples, step)
        outcomes = self.scorer.submit(calls, progress)
        return ScoringInPool(
            outcomes, samples, lambda scored: self.record(step, rank, calls, scored)
        )

    def scored(
        self,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        step: int,
        progress: Progress,
    ) -> list[RolloutSample]:
        calls = self._calls(requests, samples, step)
        # (through the pool's thread: after the batches submitted before it)
        outcomes = self.scorer.submit(calls, progress).result()
        return [
            dataclasses.replace(sample, reward=outcome.score, reward_extras=dict(outcome.extras))
            for sample, outcome in zip(samples, outcomes, strict=True)
        ]

    def _calls(
        self, requests: list[RolloutRequest], samples: list[RolloutSample], step: int
    ) -> list[RewardCall]:
        calls = [
            self._call(request, sample, step)
            for request, sample in zip(requests, samples, strict=True)
        ]
        for request in requests:
            self.pending.pop(request.request_id, None)
        return calls

    def _call(self, request: RolloutRequest, sample: RolloutSample, step: int) -> RewardCall:
        row, prompt = self.pending[request.request_id]
        return RewardCall(
            sample_id=request.request_id,
            row_index=row.index,
            completion=self.tokenizer.decode(sample.tokens),
            prompt=prompt,
            label=row.label,
            row=row.columns,
            finish_reason=sample.finish_reason,
            completion_ids=list(sample.tokens),
            step=step,
        )

    def record(
        self, step: int, rank: int, calls: list[RewardCall], samples: list[RolloutSample]
    ) -> None:
        lines = []
        for call, sample in zip(calls[: self.samples_log.per_step], samples, strict=False):
            line = sample_line(self.tokenizer, step, rank, sample, call.prompt)
            lines.append({**line, "row_index": call.row_index, "label": call.label})
        self.samples_log.write(lines)

    def close(self) -> None:
        self.scorer.close()
        self.train.rows.close()
        if self.val is not None:
            self.val.rows.close()


class FixedWorkload:
    """The simulated engines' requests: the same few every step, scored by nobody."""

    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        sampling = SamplingParams(max_tokens=4)
        return [RolloutRequest(f"r{rank}-{i}", (1, 2, 3), sampling) for i in range(FIXED_REQUESTS)]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return None

    def scored(
        self,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        step: int,
        progress: Progress,
    ) -> list[RolloutSample]:
        return samples

    def scoring(
        self,
        rank: int,
        step: int,
        requests: list[RolloutRequest],
        samples: list[RolloutSample],
        progress: Progress,
    ) -> Scoring:
        return Scored(samples)

    def validation(self, rank: int, step: int) -> list[RolloutRequest]:
        return []

    def close(self) -> None:
        """Nothing held."""


def workload(
    family: Family,
    spec: EngineChoice,
    *,
    ranks: int = 1,
    run_dir: Path | None = None,
    samples_per_step: int = 0,
) -> Workload:
    """What a rollout engine of `family` serves: the task through the job's tokenizer (loaded
    once, here: the rollout worker is the one place that tokenizes), or fixed requests.
    `ranks`: the job's (a dataset's rows are dealt among them)."""
    if family == "simulated":
        return FixedWorkload()
    source = spec.tokenizer_source()
    if source is None:
        raise ConfigError(
            f"engine.rollout = {spec.rollout!r} serves the trainer's model, but "
            f"engine.trainer = {spec.trainer!r} trains none"
        )
    tokenizer = tokenizers.load(source)
    if spec.task.kind == "dataset":
        return DatasetWorkload(
            spec.task, tokenizer, ranks=ranks, run_dir=run_dir, samples_per_step=samples_per_step
        )
    log = SamplesLog(None if run_dir is None else run_dir / SAMPLES, samples_per_step)
    return DigitWorkload(spec.task, tokenizer, log)
