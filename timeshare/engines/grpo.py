"""GRPO as every trainer computes it: the step (`GrpoTrainer.train_step`), and as pure functions
the batch as tensors, the checks on it, group-normalised advantages and the clipped loss.

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
from timeshare.engines.spec import EngineChoice, GrpoSpec, TaskSpec
from timeshare.errors import OffPolicy, TimeshareError
from timeshare.protocols.commands.results import TrainFigures
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


def batch_tensors(batch: list[RolloutSample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts, completions and the rollout's logprobs as [batch, tokens] tensors."""
    if not batch:
        raise TimeshareError("an empty batch: the rollout produced no samples")
    shapes = {(len(s.prompt_tokens), len(s.tokens)) for s in batch}
    if len(shapes) != 1:
        raise TimeshareError(f"samples of differing lengths (prompt, completion): {sorted(shapes)}")
    prompts = torch.tensor([s.prompt_tokens for s in batch], dtype=torch.long)
    completions = torch.tensor([s.tokens for s in batch], dtype=torch.long)
    sampled = torch.tensor([s.logprobs for s in batch], dtype=torch.float32)
    if not math.isfinite(float(sampled.sum())):
        raise TimeshareError("the rollout reported non-finite logprobs")
    return prompts, completions, sampled


def rewards_of(batch: list[RolloutSample]) -> torch.Tensor:
    return torch.tensor([float(s.reward or 0.0) for s in batch])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature): what trainers and rollouts report."""
    return (
        torch.log_softmax(logits.float() / temperature, dim=-1)
        .gather(-1, tokens.unsqueeze(-1))
        .squeeze(-1)
    )


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(reward - group mean) / (group std + eps), per group of `group_size` consecutive samples.

    A group whose samples all scored the same teaches nothing: its advantages are 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred / (groups.std(dim=1, keepdim=True) + EPS)).view(-1)


def clipped_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO-clip objective with asymmetric clipping, over [batch, tokens] logprobs.

    Ratios are clipped to [1 - clip_low, 1 + clip_high]. With `ref_logprobs` the k3 estimate of
    KL(policy || reference) is added with weight `kl_coef`.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    advantage = advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantage
    loss = -torch.min(unclipped, clipped).mean()
    metrics = {"clip_fraction": float((clipped < unclipped).float().mean())}  # clip in force
    if ref_logprobs is not None and kl_coef > 0:
        log_ratio = ref_logprobs - logprobs
        kl = (torch.exp(log_ratio) - log_ratio - 1.0).mean()
        loss = loss + kl_coef * kl
        metrics["kl"] = float(kl)
    return loss, metrics


class GrpoBatch(NamedTuple):
    """One TRAIN's batch as tensors, and what is computed once for all its minibatches."""

    prompts: torch.Tensor
    completions: torch.Tensor
    sampled: torch.Tensor  # the rollout's logprobs
    rewards: torch.Tensor
    old: torch.Tensor  # the policy's logprobs before this step's first update
    advantages: torch.Tensor
    ref: torch.Tensor | None  # the reference model's logprobs (a KL term only)


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
            reward_mean=float(data.rewards.mean()),
            logprob_max_abs_diff=float((data.old.cpu() - data.sampled).abs().max()),
            loss=loss,
            train_s=time.perf_counter() - started,
            extra=metrics,
        )
        self.commit()
        return self.last_train

    def prepare(self, batch: list[RolloutSample]) -> GrpoBatch:
        """The batch as tensors, with the logprobs and advantages all its minibatches use."""
        prompts, completions, sampled = batch_tensors(batch)
        rewards = rewards_of(batch)
        old = self.policy_logprobs(prompts, completions)
        ref = self.reference_logprobs(prompts, completions)
        advantages = group_advantages(rewards, self.task.group_size)
        return GrpoBatch(prompts, completions, sampled, rewards, old, advantages, ref)

    def loss(
        self, new: torch.Tensor, data: GrpoBatch, rows: slice
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped objective of `rows` of the batch, whose new logprobs are `new`."""
        return clipped_loss(
            new,
            data.old[rows],
            data.advantages[rows].to(new.device),
            clip_low=self.grpo.clip_ratio_low,
            clip_high=self.grpo.clip_ratio_high,
            ref_logprobs=None if data.ref is None else data.ref[rows],
            kl_coef=self.grpo.kl_coef,
        )

    @abstractmethod
    def policy_logprobs(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        """The trained model's logprobs of `completions`, without gradients."""

    @abstractmethod
    def reference_logprobs(
        self, prompts: torch.Tensor, completions: torch.Tensor
    ) -> torch.Tensor | None:
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
