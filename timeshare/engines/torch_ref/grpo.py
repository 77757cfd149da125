"""GRPO's two formulas, as pure functions: group-normalised advantages and the clipped loss."""

from __future__ import annotations

import torch

EPS = 1e-6


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
