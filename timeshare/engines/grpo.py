"""GRPO as every trainer computes it: the step (`GrpoTrainer.train_step`), and as pure functions
the batch as tensors (sequences.py's layout), the checks on it, group-normalised advantages and
the clipped loss over the completions' real tokens (padding is in no term and no figure).

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
from timeshare.engines.spec import EngineChoice, GrpoSpec, LossAggregation, TaskSpec
from timeshare.errors import OffPolicy, TimeshareError
from timeshare.protocols.commands.results import LengthFigures, RewardFigures, TrainFigures
from timeshare.protocols.store import JobStore

log = structlog.get_logger(__name__)

EPS = 1e-6


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


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature): what trainers and rollouts report."""
    return (
        torch.log_softmax(logits.float() / temperature, dim=-1)
        .gather(-1, tokens.unsqueeze(-1))
        .squeeze(-1)
    )


def completion_logprobs(
    logits: torch.Tensor, sequences: Sequences, temperature: float
) -> torch.Tensor:
    """[rows, completion_width]: each completion token's logprob, from the logits of
    `sequences.tokens[:, :-1]` ([rows, width - 1, vocab]; padded positions are masked)."""
    completions = sequences.completions.to(logits.device)
    return token_logprobs(completion_logits(logits, sequences), completions, temperature)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scored: torch.Tensor | None = None
) -> torch.Tensor:
    """(reward - group mean) / (group std + eps), per group of `group_size` consecutive samples,
    over the `scored` samples of each group (all, when None); a sample not scored gets 0.

    A group whose samples all scored the same teaches nothing: its advantages are 0; so does
    one with fewer than two scored samples.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
    groups = rewards.view(-1, group_size)
    if scored is None or bool(scored.all()):
        centred = groups - groups.mean(dim=1, keepdim=True)
        return (centred / (groups.std(dim=1, keepdim=True) + EPS)).view(-1)
    counted = scored.view(-1, group_size).float()
    n = counted.sum(dim=1, keepdim=True)
    mean = (groups * counted).sum(dim=1, keepdim=True) / n.clamp(min=1.0)
    centred = (groups - mean) * counted
    std = ((centred**2).sum(dim=1, keepdim=True) / (n - 1.0).clamp(min=1.0)).sqrt()
    return torch.where(n >= 2, centred / (std + EPS), 0.0).view(-1)


def token_weights(mask: torch.Tensor, aggregation: LossAggregation, chunk: int) -> torch.Tensor:
    """Each token's weight in the loss of its minibatch (rows in consecutive chunks of `chunk`):
    0.0 off the mask; "token-mean": 1 / the minibatch's tokens; "seq-mean-token-mean":
    1 / (its sequence's tokens x the minibatch's sequences). A loss is then a weighted sum, so
    micro-batches of a minibatch add up to its loss whatever their sizes."""
    rows = mask.shape[0]
    if rows % chunk:
        raise ValueError(f"{rows} rows do not form minibatches of {chunk}")
    weights = mask.float()
    for start in range(0, rows, chunk):
        part = weights[start : start + chunk]
        if aggregation == "token-mean":
            part /= max(float(part.sum()), 1.0)
        else:
            part /= part.sum(dim=1, keepdim=True).clamp(min=1.0) * chunk
    return weights


def clipped_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO-clip objective with asymmetric clipping, over [rows, tokens] logprobs, each
    token weighted by `weights` (`token_weights`: 0.0 on padding, which is in no term).

    Ratios are clipped to [1 - clip_low, 1 + clip_high]. With `ref_logprobs` the k3 estimate of
    KL(policy || reference) is added with weight `kl_coef`. The figures (clip fraction, kl) are
    means over the real tokens of these rows.
    """
    weights = weights.to(logprobs.device)
    mask = weights > 0
    tokens = max(int(mask.sum()), 1)
    # padded positions leave every term before any arithmetic (whatever they hold)
    ratio = torch.exp(torch.where(mask, logprobs - old_logprobs, 0.0))
    advantage = advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantage
    loss = -(torch.min(unclipped, clipped) * weights).sum()
    in_force = (clipped < unclipped) & mask  # clip in force
    metrics = {"clip_fraction": float(in_force.sum()) / tokens}
    if ref_logprobs is not None and kl_coef > 0:
        log_ratio = torch.where(mask, ref_logprobs - logprobs, 0.0)
        kl = torch.exp(log_ratio) - log_ratio - 1.0
        loss = loss + kl_coef * (kl * weights).sum()
        metrics["kl"] = float(kl.detach().sum()) / tokens
    return loss, metrics


def _scored_mean(rewards: torch.Tensor, scored: torch.Tensor) -> float | None:
    """The mean reward of the scored samples (None: none was)."""
    return float(rewards[scored].mean()) if bool(scored.any()) else None


def masked_max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |a - b| over the real tokens (`mask`)."""
    difference = (a.cpu() - b.cpu()).abs().masked_fill(~mask.cpu(), 0.0)
    return float(difference.max()) if difference.numel() else 0.0


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
            reward_mean=_scored_mean(data.rewards, data.scored),
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
