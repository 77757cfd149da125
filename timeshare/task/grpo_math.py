"""GRPO's maths, as pure functions over tensors: group-normalised advantages, each token's weight
in a minibatch's loss, the clipped objective (with a KL term), and logprobs at a temperature.
Engine-free: every trainer's step (engines/grpo.py) computes its loss with these, so that every
trainer computes the same GRPO.

Per-token tensors are [rows, completion tokens]; a token's weight of 0.0 (padding, or a sample
whose reward was skipped) keeps it out of every term and every figure.
"""

from __future__ import annotations

import torch

from timeshare.task.aggregation import LossAggregation

EPS = 1e-6


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature): what trainers and rollouts report."""
    return (
        torch.log_softmax(logits.float() / temperature, dim=-1)
        .gather(-1, tokens.unsqueeze(-1))
        .squeeze(-1)
    )


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


def scored_mean(rewards: torch.Tensor, scored: torch.Tensor) -> float | None:
    """The mean reward of the scored samples (None: none was)."""
    return float(rewards[scored].mean()) if bool(scored.any()) else None


def masked_max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |a - b| over the real tokens (`mask`)."""
    difference = (a.cpu() - b.cpu()).abs().masked_fill(~mask.cpu(), 0.0)
    return float(difference.max()) if difference.numel() else 0.0
