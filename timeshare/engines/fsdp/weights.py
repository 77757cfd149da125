"""The FSDP trainer's weights as the rollout engine loads them: full tensors, one at a time.

Names are the transformers names (`model.layers.0.self_attn.q_proj.weight`): `fully_shard`
keeps every name. A tied head is the embedding's parameter, which `named_parameters` yields once
as `model.embed_tokens.weight`: that is what vLLM's and the reference rollout's loaders expect
of a tied model (they skip `lm_head.weight`). Each parameter is all-gathered only when the
consumer asks for it, so the extra memory is the tensors the consumer still holds (the weight
channel: about one bucket), never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor


def gathered_weights(
    module: torch.nn.Module, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) of every parameter, gathered one at a time (collectives:
    every rank iterates, in the same order)."""
    for name, parameter in module.named_parameters():
        with torch.no_grad():
            gathered = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
            gathered = gathered.detach().to(dtype)
        yield name, gathered
        # Not kept while the next one is gathered: the consumer holds what it still needs.
        del gathered
