"""GRPO as every trainer computes it: the step (`GrpoTrainer.train_step`), the batch as tensors
(sequences.py's layout) and the checks on it; the maths (group-normalised advantages, the
clipped loss over the completions' real tokens) are timeshare/task/grpo_math.py's.

A trainer engine subclasses `GrpoTrainer` and says only how its model computes: the logprobs of
a batch without gradients (the policy's and the reference model's), and how one minibatch
updates the model. The settings are the job's `[engine.grpo]` and `[engine.task]`.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from typing import NamedTuple, Self

import msgspec
import structlog
import torch

from timeshare.engines.base import RolloutSample, TrainerEngine
from timeshare.engines.context import EngineContext
from timeshare.engines.handoff import COLLECTIVE_TIMEOUT_S, KEEP_CHECKPOINTS
from timeshare.engines.sequences import Sequences, completion_logits, pack, padded_values
from timeshare.engines.spec import EngineChoice, GrpoSpec, TaskSpec
from timeshare.errors import OffPolicy, TimeshareError
from timeshare.protocols.commands.results import LengthFigures, RewardFigures, TrainFigures
from timeshare.protocols.store import JobStore
from timeshare.task.grpo_math import (
    clipped_loss,
    group_advantages,
    masked_max_abs_diff,
    scored_mean,
    token_logprobs,
    token_weights,
)

log = structlog.get_logger(__name__)


def check_batch(batch: list[RolloutSample], version: int, group_size: int, rank: int) -> None:
    """Every sample comes from weight `version` (on policy) and the batch is whole groups."""
    stale = {s.weight_version for s in batch} - {version}
    if stale:
        raise OffPolicy(
            f"rank {rank} trains from weight version {version} but the batch has "
            f"samples of versions {sorted(stale)}"
        )
    if len(batch) % group_size:
        raise TimeshareError(f"a batch of {len(batch)} samples is not whole groups of {group_size}")


def sampled_logprobs(batch: list[RolloutSample], sequences: Sequences) -> torch.Tensor:
    """The rollout's logprobs of each completion token, [rows, completion_width] (0.0 padded)."""
    short = [s.request_id for s in batch if len(s.logprobs) != len(s.tokens)]
    if short:
        raise TimeshareError(f"samples without a logprob for each completion token: {short[:5]}")
    sampled = padded_values([s.logprobs for s in batch], sequences.completions.shape[1])
    if not math.isfinite(float(sampled.sum())):
        raise TimeshareError("the rollout reported non-finite logprobs")
    return sampled


def rewards_of(batch: list[RolloutSample]) -> torch.Tensor:
    """Each sample's reward; a skipped one (None) is 0.0 here and out of `scored_rows`."""
    return torch.tensor([0.0 if s.reward is None else float(s.reward) for s in batch])


def scored_rows(batch: list[RolloutSample]) -> torch.Tensor:
    """[rows] bool: the samples with a reward. A skipped one (the reward function returned
    None, or failed under on_error = "skip") leaves the loss and its group's statistics: a
    reward of 0 in its place would bias the group's mean."""
    return torch.tensor([s.reward is not None for s in batch], dtype=torch.bool)


def reward_figures(batch: list[RolloutSample]) -> RewardFigures:
    """The part of the batch skipped, and the mean of each extra the reward function gave."""
    names = sorted({name for s in batch for name in s.reward_extras})
    extras = {}
    for name in names:
        values = [s.reward_extras[name] for s in batch if name in s.reward_extras]
        extras[name] = sum(values) / len(values)
    skipped = sum(s.reward is None for s in batch)
    return RewardFigures(
        skipped_fraction=skipped / len(batch) if batch else 0.0, extras=extras, samples=len(batch)
    )


def completion_logprobs(
    logits: torch.Tensor, sequences: Sequences, temperature: float
) -> torch.Tensor:
    """[rows, completion_width]: each completion token's logprob, from the logits of
    `sequences.tokens[:, :-1]` ([rows, width - 1, vocab]; padded positions are masked)."""
    completions = sequences.completions.to(logits.device)
    return token_logprobs(completion_logits(logits, sequences), completions, temperature)


def length_figures(batch: list[RolloutSample], sequences: Sequences) -> LengthFigures:
    """The completions' lengths (mean, max), the part that reached `max_completion_tokens`
    without a stop token, and the padding share of the batch as laid out for TRAIN."""
    lengths = [len(s.tokens) for s in batch]
    return LengthFigures(
        completion_tokens_mean=sum(lengths) / len(lengths),
        completion_tokens_max=max(lengths),
        truncated_fraction=sum(s.finish_reason == "length" for s in batch) / len(batch),
        padding_share=sequences.padding_share(),
        samples=len(batch),
    )


class GrpoBatch(NamedTuple):
    """One TRAIN's batch as tensors (sequences.py's layout), and what is computed once for
    all its minibatches. Per-token tensors are [rows, completion_width]."""

    sequences: Sequences
    sampled: torch.Tensor  # the rollout's logprobs
    rewards: torch.Tensor
    old: torch.Tensor  # the policy's logprobs before this step's first update
    advantages: torch.Tensor
    ref: torch.Tensor | None  # the reference model's logprobs (a KL term only)
    weights: torch.Tensor  # each token's weight in its minibatch's loss (token_weights)
    scored: torch.Tensor  # [rows] bool: the samples with a reward (scored_rows)


class GrpoTrainer(TrainerEngine):
    """The GRPO step: on-policy check, old and reference logprobs, group advantages, then one
    optimiser step per minibatch; the step is committed (durable) before it is reported."""

    rank: int
    task: TaskSpec
    grpo: GrpoSpec
    # From the job ([job], [cluster]), set by from_context:
    keep_checkpoints: int = KEEP_CHECKPOINTS
    resume_on_fewer_ranks: bool = False  # a checkpoint of more ranks is resharded (min_nodes)

    @abstractmethod
    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: EngineChoice,
        *,
        store: JobStore | None = None,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None: ...

    @classmethod
    def from_context(cls, context: EngineContext) -> Self:
        """The registry's builder (registry.py): this trainer of `context`'s rank."""
        trainer = cls(
            context.rank,
            context.world_size,
            context.spec,
            store=context.store,
            collective_timeout_s=context.collective_timeout_s,
        )
        trainer.keep_checkpoints = context.keep_checkpoints
        trainer.resume_on_fewer_ranks = context.resume_on_fewer_ranks
        return trainer

    def train_step(self, batch: list[RolloutSample]) -> TrainFigures:
        started = time.perf_counter()
        check_batch(batch, self.step, self.task.group_size, self.rank)
        self.onload()
        data = self.prepare(batch)
        size = len(batch) // self.grpo.minibatches
        loss, metrics = 0.0, dict[str, float]()
        for start in range(0, len(batch), size):
            loss, metrics = self.update(data, range(start, start + size))
            self.progress()
        self.step += 1
        self.last_train = TrainFigures(
            step=self.step,
            samples=len(batch),
            committed=self.step,
            reward_mean=scored_mean(data.rewards, data.scored),
            logprob_max_abs_diff=masked_max_abs_diff(data.old, data.sampled, data.sequences.mask),
            loss=loss,
            train_s=time.perf_counter() - started,
            extra=metrics,
            lengths=length_figures(batch, data.sequences),
            rewards=reward_figures(batch),
        )
        self.commit()
        return self.last_train

    def prepare(self, batch: list[RolloutSample]) -> GrpoBatch:
        """The batch as tensors, with the logprobs and advantages all its minibatches use."""
        sequences = pack(batch)
        sampled = sampled_logprobs(batch, sequences)
        rewards = rewards_of(batch)
        scored = scored_rows(batch)
        old = self.policy_logprobs(sequences)
        ref = self.reference_logprobs(sequences)
        advantages = group_advantages(rewards, self.task.group_size, scored)
        # a skipped sample's tokens weigh nothing (they stay in the logprob check)
        trained = sequences.mask & scored.unsqueeze(1)
        weights = self.token_weights(trained, len(batch) // self.grpo.minibatches)
        return GrpoBatch(sequences, sampled, rewards, old, advantages, ref, weights, scored)

    def token_weights(self, mask: torch.Tensor, minibatch_rows: int) -> torch.Tensor:
        """Each token's weight in its minibatch's loss, as `[engine.grpo] loss_aggregation`
        says."""
        return token_weights(mask, self.grpo.loss_aggregation, minibatch_rows)

    def loss(
        self, new: torch.Tensor, data: GrpoBatch, rows: slice
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped objective's share of `rows` in their minibatch's loss, whose new
        logprobs are `new` (the shares of a minibatch's micro-batches add up to its loss)."""
        # A part may be computed trimmed to its own widths (Sequences.select): the columns
        # past them are padding in each of its rows, of weight 0.
        width = new.shape[1]
        return clipped_loss(
            new,
            data.old[rows, :width].to(new.device),
            data.advantages[rows].to(new.device),
            data.weights[rows, :width],
            clip_low=self.grpo.clip_ratio_low,
            clip_high=self.grpo.clip_ratio_high,
            ref_logprobs=None if data.ref is None else data.ref[rows, :width].to(new.device),
            kl_coef=self.grpo.kl_coef,
        )

    @abstractmethod
    def policy_logprobs(self, sequences: Sequences) -> torch.Tensor:
        """The trained model's logprobs of the completions, [rows, completion_width], without
        gradients."""

    @abstractmethod
    def reference_logprobs(self, sequences: Sequences) -> torch.Tensor | None:
        """The reference model's logprobs, without gradients (None: no KL term)."""

    @abstractmethod
    def update(self, data: GrpoBatch, rows: range) -> tuple[float, dict[str, float]]:
        """One optimiser step on the minibatch `rows`; its loss and figures."""

    @abstractmethod
    def commit(self) -> None:
        """Make the step just trained durable (its checkpoint), before TRAIN reports it."""


def figures_kept(kept: object) -> TrainFigures | None:
    """The TRAIN figures a checkpoint kept (None: none, or unreadable, which is logged).

    Checkpoints written before the figures were typed keep a flat dict of floats: its known
    keys become the typed fields, the rest `extra`."""
    if kept is None:
        return None
    if isinstance(kept, dict) and "extra" not in kept and kept.keys() >= _FLAT_KEYS:
        kept = _typed_from_flat(kept)
    try:
        return msgspec.convert(kept, TrainFigures)
    except msgspec.ValidationError as exc:
        log.warning("trainer.checkpoint.figures_unreadable", error=str(exc))
        return None


_FLAT_KEYS = {"step", "samples"}
_INTEGERS = ("step", "samples", "committed")


def _typed_from_flat(flat: dict[str, object]) -> dict[str, object]:
    fields = set(TrainFigures.__struct_fields__) - {"extra"}
    typed: dict[str, object] = {k: v for k, v in flat.items() if k in fields}
    for key in _INTEGERS:
        value = typed.get(key)
        if isinstance(value, float):
            typed[key] = int(value)
    typed["extra"] = {k: v for k, v in flat.items() if k not in fields}
    return typed
