"""The verifiable task shipped with the package: say the digit back.

A prompt is `BOS d SEP` for a digit d; the right completion is d, d, d, ... . The reward of a
completion is the fraction of its tokens equal to d, so it lies in [0, 1]; a random model scores
about 1/vocab and a few dozen GRPO steps of a small model bring it near 1. The prompts of a step
are a function of (seed, rank, step) alone, which makes the data position a step number: a run
resumed from step k sees exactly the prompts it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from timeshare.engines.torch_ref.vocab import BOS, DIGITS, PROMPT_TOKENS, SEP


@dataclass(frozen=True)
class RepeatDigit:
    completion_tokens: int = 6

    def prompts(self, seed: int, rank: int, step: int, count: int) -> list[tuple[int, ...]]:
        generator = torch.Generator().manual_seed(mix(seed, rank, step, 1))
        digits = torch.randint(0, DIGITS, (count,), generator=generator).tolist()
        return [(BOS, d, SEP) for d in digits]

    def reward(self, prompt: tuple[int, ...], completion: tuple[int, ...]) -> float:
        if len(prompt) != PROMPT_TOKENS or not completion:
            return 0.0
        return sum(token == prompt[1] for token in completion) / len(completion)


def mix(*parts: int) -> int:
    """One 63-bit seed from several integers (distinct tuples give unrelated streams)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (part + 0x632BE59BD9B4E019 + (value << 6) + (value >> 2))) & (2**63 - 1)
    return value


def sampling_seed(seed: int, rank: int, step: int) -> int:
    return mix(seed, rank, step, 2)
