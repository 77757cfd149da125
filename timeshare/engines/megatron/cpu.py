"""What megatron-core needs to train on a CPU, each accommodation narrow and named.

megatron-core is written for CUDA; three of its pieces allocate on a CUDA device whatever the
model's device. Each has a stand-in here, installed only when the trainer's device is a CPU
(`model.build_model`), so that on GPUs megatron runs as its authors wrote it:

- `SdpaAttention` takes the layer spec's `core_attention` slot: megatron's local
  `DotProductAttention` takes its score buffer from `get_global_memory_buffer()`, a CUDA buffer.
  The stand-in is torch's scaled-dot-product attention over the same inputs and outputs.
- `keep_rotary_on_host` replaces `RotaryEmbedding.get_emb` on the model's own rotary object (not
  the class): megatron's moves `inv_freq` to `torch.cuda.current_device()` at the first forward.
- The RNG tracker is seeded with `inference_rng_tracker=True` (model.py): its `fork()`, which
  swaps CUDA RNG states around dropout, becomes a no-op. Training here has no dropout.

No process-wide `torch.cuda` patch: each stand-in touches one object of one model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from timeshare.engines.invariance import row_local_attention


class SdpaAttention(MegatronModule):  # type: ignore[misc]  # megatron is untyped
    """Causal attention for the layer spec's `core_attention`, through torch SDPA: queries
    [sq, b, heads, d], keys and values [sk, b, groups, d] (grouped-query attention), out
    [sq, b, heads * d], as megatron's `DotProductAttention` takes and gives them."""

    def __init__(  # noqa: PLR0917 - megatron builds its core attention with these, in order
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SdpaAttention: no context parallelism (a CPU stand-in)")
        self.softmax_scale = softmax_scale

    def forward(  # noqa: PLR0917 - megatron calls its core attention with these, in order
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            name = type(self).__name__
            raise NotImplementedError(f"{name}: no attention bias or packed sequences")
        # [s, b, n, d] -> [b, n, s, d]; causal over the whole sequence (no padding: the
        # trainer's batches are rectangular)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self.attend(q, k, v)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of [b, n, s, d] queries over [b, groups, s, d] keys and values."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
        )


class RowLocalAttention(SdpaAttention):
    """`SdpaAttention` in the batch-invariant mode (engines/invariance.py): each query over its
    own visible keys alone, as the reference rollout computes it."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if self.softmax_scale is None else self.softmax_scale
        return row_local_attention(q, k, v, k.shape[2] - q.shape[2], scale)


def keep_rotary_on_host(rotary: RotaryEmbedding) -> None:
    """Make `rotary` compute its embedding where its `inv_freq` is (the host), instead of
    moving `inv_freq` to the current CUDA device first."""
    if rotary.rotary_interleaved:
        raise NotImplementedError("keep_rotary_on_host: interleaved rotary embeddings")

    def get_emb(max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = rotary.get_freqs_non_repeated(max_seq_len, offset)  # [s, d/2]
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, d]

    rotary.get_emb = get_emb
