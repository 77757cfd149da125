"""The digit task, as data read through the job's tokenizer: say the digit back, then stop.

An example is a chat of one user turn, a digit said one to `PROMPT_DIGITS` times ("7 7"), and
its answer, the digit `ANSWER_DIGITS` times ("7"); the right completion is the answer's tokens,
then EOS. Token ids come from the tokenizer alone (tokenizer.py): through the digit task's own
(digit_tokenizer.py) a prompt is `BOS d.. SEP` and the answer `d EOS`; through a user's
tokenizer they are its own.

The reward of a completion that stops (has an EOS) is half for the digits (the share of the
answer's positions it got right) and half for stopping right after them; a completion cut at the
limit without an EOS earns 0 (an overlong penalty, as DAPO's). So it lies in [0, 1], and a random
model scores about 0.06. Why this shape (measured on the demo's model, 30 steps): weighting the
EOS as one position among the digits, a small model learnt "say d" everywhere first and, without
a KL term, never sampled an EOS after the digits again (stuck at 0.75, every completion cut at
the limit); without the overlong rule the same happened (stuck at 0.5); with three answer digits
and the rule it learnt to stop but said the digits slowly (0.58 to 0.67 at step 30). One digit,
then EOS: 0.84 to 0.87 at step 30, with or without a KL term, every completion stopping at its
EOS. The examples of a step are a function of (seed, rank, step) alone: a run resumed from step
k sees exactly the prompts it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from timeshare.task.seeds import mix
from timeshare.task.tokenizer import Message, TaskTokenizer, digit_task_tokenizer
from timeshare.task.vocab import ANSWER_DIGITS, DIGITS, PROMPT_DIGITS


@dataclass(frozen=True)
class Example:
    messages: tuple[Message, ...]  # the prompt, as a chat
    answer: str  # the right completion's text (then EOS)


def example(digit: int, repeats: int) -> Example:
    said = " ".join([str(digit)] * repeats)
    return Example(({"role": "user", "content": said},), " ".join([str(digit)] * ANSWER_DIGITS))


def every_example() -> list[Example]:
    return [example(d, n) for d in range(DIGITS) for n in range(1, PROMPT_DIGITS + 1)]


def examples(seed: int, rank: int, step: int, count: int) -> list[Example]:
    """Rank `rank`'s `count` examples of step `step`: random digits, every length in every
    batch (count >= PROMPT_DIGITS), in an order that varies."""
    generator = torch.Generator().manual_seed(mix(seed, rank, step, 1))
    digits = torch.randint(0, DIGITS, (count,), generator=generator).tolist()
    offset = int(torch.randint(0, PROMPT_DIGITS, (1,), generator=generator))
    repeats = [1 + (offset + i) % PROMPT_DIGITS for i in range(count)]
    return [example(d, n) for d, n in zip(digits, repeats, strict=True)]


@dataclass(frozen=True)
class RepeatDigit:
    """The digit task in the ids of `tokenizer` (the digit task's own unless given)."""

    tokenizer: TaskTokenizer = field(default_factory=digit_task_tokenizer)
    # each prompt's right completion, both as the tokenizer gives them
    answers: dict[tuple[int, ...], tuple[int, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        answers = {
            self.tokenizer.prompt_ids(e.messages): (
                *self.tokenizer.text_ids(e.answer),
                self.tokenizer.eos_id,
            )
            for e in every_example()
        }
        object.__setattr__(self, "answers", answers)

    def prompts(self, seed: int, rank: int, step: int, count: int) -> list[tuple[int, ...]]:
        """The prompt ids of `examples(seed, rank, step, count)`."""
        return [self.tokenizer.prompt_ids(e.messages) for e in examples(seed, rank, step, count)]

    def answer(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        """The right completion of `prompt` (() for a prompt not of the task)."""
        return self.answers.get(tuple(prompt), ())

    def reward(self, prompt: tuple[int, ...], completion: tuple[int, ...]) -> float:
        answer = self.answer(prompt)
        if not answer or not completion:
            return 0.0
        said, stop = answer[:-1], answer[-1]
        if stop not in completion:
            return 0.0  # it never stopped: cut at the limit, it earns nothing
        right = sum(got == want for got, want in zip(completion, said, strict=False))
        stopped = len(completion) == len(answer) and completion[-1] == stop
        return 0.5 * right / len(said) + 0.5 * stopped

    def longest_prompt(self) -> int:
        return max(len(prompt) for prompt in self.answers)
