"""The batch-invariant mode's attention (engines/invariance.py) as one transformers can choose
(`attn_implementation`): the FSDP trainer's model computes each query's attention as the
reference rollout does, over its own visible keys alone. Imported only where transformers is."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from timeshare.engines.invariance import row_local_attention

ROW_LOCAL = "timeshare_row_local"  # its name among transformers' attention implementations


def row_local_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: `query` [batch, heads, seq, dim], `key` and `value`
    [batch, kv_heads, keys, dim]; the output [batch, seq, heads, dim]. Causal, and nothing
    more: the trainer's rows are right-padded (sequences.py), so no real token's visible keys
    hold a pad, and the mask (of padding, if any) adds nothing to that."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    first = key.shape[2] - query.shape[2]
    out = row_local_attention(query, key, value, first, scale)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make the row-local attention one transformers can choose; its name."""
    transformers.AttentionInterface.register(ROW_LOCAL, row_local_attention_forward)
    return ROW_LOCAL
