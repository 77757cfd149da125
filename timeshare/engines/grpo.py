"""GRPO as both trainers compute it (torch_ref and FSDP): the batch as tensors, the checks on it,
group-normalised advantages and the clipped loss, as pure functions.
"""

from __future__ import annotations

import math

import torch

from timeshare.engines.base import RolloutSample
from timeshare.errors import OffPolicy, TimeshareError

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
