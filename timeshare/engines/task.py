"""What the rollout serves: the shipped task (say the digit back), or fixed requests.

The task (timeshare/task/digits.py) is data: chat prompts and the answers they want, read
through the job's tokenizer (timeshare/task/tokenizer.py), which this worker alone holds: a
request carries the prompt's token ids only, and every engine stops at the job's one stop set
(the tokenizer's EOS, the generation config's, `[engine.task] stop_token_ids`). The prompts of a
step are a function of (seed, rank, step) alone, which makes the data position a step number: a
run resumed from step k sees exactly the prompts it would have seen.

Every engine of the `causal_lm` family serves the task (`TaskWorkload`); the simulated engines
serve fixed requests with no reward (`FixedWorkload`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from timeshare.engines.base import RolloutRequest, RolloutSample, SamplingParams
from timeshare.engines.registry import Family
from timeshare.engines.spec import TaskSpec
from timeshare.errors import ConfigError
from timeshare.task import tokenizer as tokenizers
from timeshare.task.digits import RepeatDigit
from timeshare.task.seeds import mix
from timeshare.task.tokenizer import TaskTokenizer

if TYPE_CHECKING:
    from timeshare.engines.spec import EngineChoice

__all__ = [
    "FixedWorkload",
    "RepeatDigit",
    "TaskWorkload",
    "Workload",
    "mix",
    "sampling_seed",
    "workload",
]

FIXED_REQUESTS = 4


class Workload(Protocol):
    def requests(self, rank: int, step: int) -> list[RolloutRequest]: ...

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None: ...


def sampling_seed(seed: int, rank: int, step: int) -> int:
    return mix(seed, rank, step, 2)


@dataclass(frozen=True)
class TaskWorkload:
    """The shipped task: each prompt `group_size` times, seeded by (seed, rank, step), its
    prompts through `tokenizer` (the digit task's own unless given)."""

    spec: TaskSpec
    tokenizer: TaskTokenizer = field(default_factory=tokenizers.digit_task_tokenizer)
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
        sampling = SamplingParams(
            max_tokens=self.spec.max_completion_tokens,
            temperature=self.spec.temperature,
            top_p=self.spec.top_p,
            seed=sampling_seed(self.spec.seed, rank, step),
            stop_token_ids=self.tokenizer.stop_set(self.spec.stop_token_ids),
        )
        prompts = self.task.prompts(self.spec.seed, rank, step, self.spec.prompts_per_rank)
        return [
            RolloutRequest(f"s{step}-r{rank}-p{p}-g{g}", prompt, sampling)
            for p, prompt in enumerate(prompts)
            for g in range(self.spec.group_size)
        ]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return self.task.reward(request.prompt_tokens, sample.tokens)


class FixedWorkload:
    """The simulated engines' requests: the same few every step, scored by nobody."""

    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        sampling = SamplingParams(max_tokens=4)
        return [RolloutRequest(f"r{rank}-{i}", (1, 2, 3), sampling) for i in range(FIXED_REQUESTS)]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return None


def workload(family: Family, spec: EngineChoice) -> Workload:
    """What a rollout engine of `family` serves: the task through the job's tokenizer (loaded
    once, here: the rollout worker is the one place that tokenizes), or fixed requests."""
    if family == "simulated":
        return FixedWorkload()
    source = spec.tokenizer_source()
    if source is None:
        raise ConfigError(
            f"engine.rollout = {spec.rollout!r} serves the trainer's model, but "
            f"engine.trainer = {spec.trainer!r} trains none"
        )
    return TaskWorkload(spec.task, tokenizers.load(source))
