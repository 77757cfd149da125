"""What the rollout serves: the shipped task (say the digit back), or fixed requests.

The task: a prompt is `BOS d.. SEP`, a digit d said one to three times (prompts of three
lengths in every batch); the right completion is d three times, then EOS. The reward of a
completion is the fraction of those four positions it got right (a completion that stops early
misses the rest; one that goes on misses the EOS), so it lies in [0, 1]; a random model scores
about 1/vocab and a few dozen GRPO steps of a small model bring it near 1, every completion then
stopping at its EOS. The prompts of a step are a function of (seed, rank, step) alone, which
makes the data position a step number: a run resumed from step k sees exactly the prompts it
would have seen.

Every engine of the `causal_lm` family serves the task (`TaskWorkload`); the simulated engines
serve fixed requests with no reward (`FixedWorkload`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from timeshare.engines.base import RolloutRequest, RolloutSample, SamplingParams
from timeshare.engines.registry import Family
from timeshare.engines.spec import TaskSpec
from timeshare.engines.vocab import (
    ANSWER_DIGITS,
    BOS,
    DIGITS,
    EOS,
    PROMPT_DIGITS,
    PROMPT_TOKENS,
    SEP,
)

FIXED_REQUESTS = 4


class Workload(Protocol):
    def requests(self, rank: int, step: int) -> list[RolloutRequest]: ...

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None: ...


@dataclass(frozen=True)
class RepeatDigit:
    def prompts(self, seed: int, rank: int, step: int, count: int) -> list[tuple[int, ...]]:
        generator = torch.Generator().manual_seed(mix(seed, rank, step, 1))
        digits = torch.randint(0, DIGITS, (count,), generator=generator).tolist()
        # every length in every batch (count >= PROMPT_DIGITS), in an order that varies
        offset = int(torch.randint(0, PROMPT_DIGITS, (1,), generator=generator))
        repeats = [1 + (offset + i) % PROMPT_DIGITS for i in range(count)]
        return [(BOS, *[d] * n, SEP) for d, n in zip(digits, repeats, strict=True)]

    def answer(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        """The right completion of `prompt`."""
        return (*[prompt[1]] * ANSWER_DIGITS, EOS)

    def reward(self, prompt: tuple[int, ...], completion: tuple[int, ...]) -> float:
        if not 3 <= len(prompt) <= PROMPT_TOKENS or not completion:
            return 0.0
        answer = self.answer(prompt)
        return sum(got == want for got, want in zip(completion, answer, strict=False)) / len(answer)


def mix(*parts: int) -> int:
    """One 63-bit seed from several integers (distinct tuples give unrelated streams)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (part + 0x632BE59BD9B4E019 + (value << 6) + (value >> 2))) & (2**63 - 1)
    return value


def sampling_seed(seed: int, rank: int, step: int) -> int:
    return mix(seed, rank, step, 2)


@dataclass(frozen=True)
class TaskWorkload:
    """The shipped task: each prompt `group_size` times, seeded by (seed, rank, step)."""

    spec: TaskSpec

    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        sampling = SamplingParams(
            max_tokens=self.spec.max_completion_tokens,
            temperature=self.spec.temperature,
            top_p=self.spec.top_p,
            seed=sampling_seed(self.spec.seed, rank, step),
            stop_token_ids=self.spec.stop_set(),
        )
        prompts = self.task.prompts(self.spec.seed, rank, step, self.spec.prompts_per_rank)
        return [
            RolloutRequest(f"s{step}-r{rank}-p{p}-g{g}", prompt, sampling)
            for p, prompt in enumerate(prompts)
            for g in range(self.spec.group_size)
        ]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return self.task.reward(request.prompt_tokens, sample.tokens)

    @property
    def task(self) -> RepeatDigit:
        return RepeatDigit()


class FixedWorkload:
    """The simulated engines' requests: the same few every step, scored by nobody."""

    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        sampling = SamplingParams(max_tokens=4)
        return [RolloutRequest(f"r{rank}-{i}", (1, 2, 3), sampling) for i in range(FIXED_REQUESTS)]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return None


def workload(family: Family, spec: TaskSpec) -> Workload:
    """What a rollout engine of `family` serves."""
    return FixedWorkload() if family == "simulated" else TaskWorkload(spec)
