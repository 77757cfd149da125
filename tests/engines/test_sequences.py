"""The shared layout of a variable-length batch (sequences.py) and what GRPO makes of it: a
completion that stops at its EOS is trained on its tokens through the EOS and not one more."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from timeshare.engines.base import FinishReason, RolloutSample
from timeshare.engines.sequences import PAD, pack, unpadded
from timeshare.engines.spec import engine_spec
from timeshare.engines.torch_ref.trainer import TorchRefTrainer
from timeshare.task.grpo_math import (
    EPS,
    clipped_loss,
    group_advantages,
    masked_max_abs_diff,
    token_weights,
)
from timeshare.task.vocab import BOS, EOS, SEP


def sample(prompt: tuple[int, ...], tokens: tuple[int, ...], reward: float = 0.0) -> RolloutSample:
    finish: FinishReason = "stop" if tokens[-1] == EOS else "length"
    logprobs = tuple(-0.5 - i for i in range(len(tokens)))
    return RolloutSample(
        f"s{len(prompt)}-{len(tokens)}-{reward}",
        tokens,
        logprobs,
        0,
        prompt_tokens=prompt,
        reward=reward,
        finish_reason=finish,
    )


BATCH = [
    sample((BOS, 3, SEP), (3, EOS), 1.0),  # stopped at its EOS: 2 tokens
    sample((BOS, 4, 4, 4, SEP), (4, 4, 4, 4, 4), 0.0),  # reached the length: 5 tokens
    sample((BOS, 5, 5, SEP), (5, 5, 5, EOS), 0.5),
    sample((BOS, 6, SEP), (1, 2, 3), 0.25),
]


def test_rows_are_prompt_then_completion_then_padding_right_padded() -> None:
    packed = pack(BATCH)
    assert packed.widths == (10, 5)  # the longest prompt + completion; the longest completion
    assert packed.tokens[0].tolist() == [BOS, 3, SEP, 3, EOS, *[PAD] * 5]
    assert packed.tokens[1].tolist() == [BOS, 4, 4, 4, SEP, 4, 4, 4, 4, 4]
    assert packed.prompt_lengths.tolist() == [3, 5, 4, 3]
    assert packed.mask.sum(dim=1).tolist() == [2, 5, 4, 3]
    # completion token j of row r is predicted by the logit at prompt_length - 1 + j
    assert packed.completion_positions()[2].tolist() == [3, 4, 5, 6, 7]
    assert packed.completion_positions()[0][:2].tolist() == [2, 3]
    assert packed.padding_share() == pytest.approx(1 - (3 + 2 + 5 + 5 + 4 + 4 + 3 + 3) / 40)
    trimmed = packed.select(slice(2, 4))
    assert trimmed.widths == (8, 4)  # only what those rows need
    values = torch.arange(20, dtype=torch.float32).view(4, 5)
    assert unpadded(values, packed)[0] == (0.0, 1.0)
    assert masked_max_abs_diff(values, torch.zeros(4, 5), packed.mask) == 17.0  # not 19: padded


def test_the_losses_weights_cover_each_completion_through_its_eos_and_no_padding() -> None:
    mask = pack(BATCH).mask
    token_mean = token_weights(mask, "token-mean", 4)
    assert torch.equal(token_mean > 0, mask)
    assert float(token_mean.sum()) == pytest.approx(1.0)
    assert float(token_mean[0, 0]) == pytest.approx(1 / 14)  # every real token alike
    by_sequence = token_weights(mask, "seq-mean-token-mean", 2)  # two minibatches of two
    assert float(by_sequence[:2].sum()) == pytest.approx(1.0)
    assert float(by_sequence[0, 0]) == pytest.approx(1 / 2 / 2)  # 2 tokens in row 0
    assert float(by_sequence[1, 0]) == pytest.approx(1 / 5 / 2)


def test_a_completion_that_stops_at_eos_is_trained_on_its_tokens_through_the_eos_only() -> None:
    """The gradient of TRAIN's loss reaches each completion's logprobs up to and including its
    EOS and not one position more; what a padded position holds changes nothing."""
    spec = engine_spec(
        trainer="torch_ref",
        rollout="torch_ref",
        task={"prompts_per_rank": 1, "group_size": 4},
        grpo={"minibatches": 1, "kl_coef": 0.1},
    )
    trainer = TorchRefTrainer(0, 1, spec)
    data = trainer.prepare(BATCH)
    new = trainer._logprobs(trainer.model, data.sequences)
    new.retain_grad()
    loss, _ = trainer.loss(new, data, slice(0, 4))
    torch.autograd.backward(loss)
    assert new.grad is not None
    reached = new.grad != 0
    assert torch.equal(reached, data.sequences.mask), reached
    # row 0 stopped at its EOS (position 1): trained on 2 tokens, not one more
    assert reached[0].tolist() == [True, True, False, False, False]
    garbage = torch.where(data.sequences.mask, new.detach(), torch.tensor(float("nan")))
    again, _ = clipped_loss(
        garbage,
        torch.where(data.sequences.mask, data.old, torch.tensor(float("inf"))),
        data.advantages,
        data.weights,
        clip_low=0.2,
        clip_high=0.28,
        ref_logprobs=data.ref,
        kl_coef=0.1,
    )
    assert float(again.detach()) == pytest.approx(float(loss.detach()), abs=1e-6)


def test_trainer_logprobs_of_a_padded_batch_are_those_of_each_row_alone() -> None:
    trainer = TorchRefTrainer(0, 1, engine_spec(trainer="torch_ref", rollout="torch_ref"))
    together = trainer.logprobs(BATCH)
    for row, one in enumerate(BATCH):
        alone = trainer.logprobs([one])[0]
        assert len(together[row]) == len(one.tokens)
        assert together[row] == pytest.approx(alone, abs=1e-5)


def test_a_skipped_sample_leaves_the_loss_and_its_groups_statistics() -> None:
    """A sample whose reward was skipped (None) gets no gradient and no advantage, and its
    group's mean and std are those of the others: a 0 in its place would bias them."""
    spec = engine_spec(
        trainer="torch_ref",
        rollout="torch_ref",
        task={"prompts_per_rank": 1, "group_size": 4},
        grpo={"minibatches": 1},
    )
    trainer = TorchRefTrainer(0, 1, spec)
    skipped = [*BATCH[:2], dataclasses.replace(BATCH[2], reward=None), BATCH[3]]
    data = trainer.prepare(skipped)
    new = trainer._logprobs(trainer.model, data.sequences)
    new.retain_grad()
    loss, _ = trainer.loss(new, data, slice(0, 4))
    torch.autograd.backward(loss)
    assert new.grad is not None
    reached = (new.grad != 0).any(dim=1).tolist()
    assert reached == [True, True, False, True]
    others = torch.tensor([1.0, 0.0, 0.25])
    expected = (others - others.mean()) / (others.std() + EPS)
    assert data.advantages[2] == 0.0
    assert torch.allclose(data.advantages[[0, 1, 3]], expected)
    assert data.scored.tolist() == [True, True, False, True]


def test_a_group_with_fewer_than_two_scored_samples_teaches_nothing() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    scored = torch.tensor([False, True, False, False])
    assert group_advantages(rewards, 4, scored).tolist() == [0.0, 0.0, 0.0, 0.0]
    every = torch.ones(4, dtype=torch.bool)
    assert torch.equal(group_advantages(rewards, 4, every), group_advantages(rewards, 4))
