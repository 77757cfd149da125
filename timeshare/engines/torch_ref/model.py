"""A small causal LM of the Llama architecture, built offline: from a config and a seed, or from
a local checkpoint directory (`config.json` in the transformers layout plus a state dict).

Parameter names follow transformers' Llama (`model.layers.0.self_attn.q_proj.weight`, ...), so a
checkpoint written by one loads in the other. The same module serves the trainer (a full causal
forward) and the rollout engine (`prefill`, then one token at a time with `decode`, against a
preallocated KV cache the engine owns). Prompts of a batch may differ in length: the prefill
reads them right-padded, and each row then decodes at its own position (`KVCache.next`), its
keys past that position masked, so that every token sits where the trainer's right-padded
forward puts it (engines/sequences.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from timeshare.engines.invariance import padded_linear, row_local_attention
from timeshare.engines.model_config import ModelConfig
from timeshare.errors import ConfigError

STATE_DICT_FILES = ("pytorch_model.bin", "model.pt")


class Linear(nn.Linear):
    """`nn.Linear`, which in the batch-invariant mode (invariance.py) makes each call one GEMM
    of enough rows to round each row alike."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return padded_linear(x, self.weight, self.bias)
        return super().forward(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of `x` [batch, heads, seq, head_dim] at `positions` [seq] (every row
    alike) or [batch, 1, seq] (each row its own)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class KVCache:
    """Preallocated keys and values per layer: [layers, batch, kv_heads, max_len, head_dim].
    `next` [batch]: the position each row's next token takes (set by a prefill)."""

    def __init__(self, config: ModelConfig, batch: int, max_len: int) -> None:
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_len)
        self.keys = torch.zeros(*shape, config.head_dim)
        self.values = torch.zeros(*shape, config.head_dim)
        self.next = torch.zeros(batch, dtype=torch.long)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        self.batch_invariant = False  # attention as row-local sums (invariance.py)
        heads, kv_heads, head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = Linear(config.hidden_size, heads * head_dim, bias=False)
        self.k_proj = Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.v_proj = Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.o_proj = Linear(heads * head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        """`x` [batch, seq, hidden] at `positions`: [seq] from 0 (a whole sequence, or a
        prefill written into `cache`), or [batch, 1, 1] (one token per row, decoded at each
        row's own position against `cache`)."""
        batch, seq, _ = x.shape
        c = self.config
        q = self.q_proj(x).view(batch, seq, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        if positions.dim() > 1:
            assert cache is not None
            out = self._decode(q, k, v, positions.view(batch), cache)
        else:
            if cache is not None:
                cache.keys[self.layer, :batch, :, :seq] = k
                cache.values[self.layer, :batch, :, :seq] = v
            out = self._attend(q, k, v)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of queries at the last positions of the keys' span."""
        seq, kv_len = q.shape[2], k.shape[2]
        if self.batch_invariant:
            return row_local_attention(q, k, v, kv_len - seq, self.config.head_dim**-0.5)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # Query i sits at position (kv_len - seq + i) and sees keys up to there.
        visible = torch.ones(seq, kv_len, dtype=torch.bool).tril(diagonal=kv_len - seq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """One token per row, row r at position `at[r]`: its key and value written there, its
        query over the row's keys up to there."""
        rows = torch.arange(q.shape[0])
        cache.keys[self.layer, rows, :, at] = k[:, :, 0]
        cache.values[self.layer, rows, :, at] = v[:, :, 0]
        if not self.batch_invariant:  # one attention, each row's later keys masked
            span = int(at.max()) + 1
            visible = (torch.arange(span) <= at.unsqueeze(1)).view(q.shape[0], 1, 1, span)
            keys = cache.keys[self.layer, : q.shape[0], :, :span]
            values = cache.values[self.layer, : q.shape[0], :, :span]
            groups = q.shape[1] // keys.shape[1]
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        out = torch.empty_like(q)
        # Batch-invariant: rows at one position attend together, over exactly their visible
        # keys (no masked ones), so that each row's sums are those of the trainer's forward.
        for position in sorted(set(at.tolist())):
            same = (at == position).nonzero().squeeze(1)
            keys = cache.keys[self.layer, same, :, : position + 1]
            values = cache.values[self.layer, same, :, : position + 1]
            out[same] = self._attend(q[same], keys, values)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def batch_invariant(self) -> bool:
        return self.lm_head.batch_invariant

    def set_batch_invariant(self, on: bool) -> None:
        """Every linear layer and attention of the model in the batch-invariant mode, or none
        (the process must have turned strict GEMMs on: invariance.enable_strict_gemm)."""
        for module in self.modules():
            if isinstance(module, Linear | Attention):
                module.batch_invariant = on

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] of `tokens` [batch, seq] (right-padded rows: a row's
        logits are those it has alone)."""
        return self._run(tokens, torch.arange(tokens.shape[1]), None)

    def prefill(self, prompts: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next token's logits [batch, vocab] after each prompt of `prompts` [batch, len]
        (right-padded; row r's prompt is its first `lengths[r]` tokens), written into `cache`."""
        logits = self._run(prompts, torch.arange(prompts.shape[1]), cache)
        cache.next[: len(lengths)] = lengths
        rows = torch.arange(len(lengths))
        last: torch.Tensor = logits[rows, lengths - 1]
        return last

    def decode(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next token's logits [batch, vocab] after one more token per row, `token`
        [batch], each at its row's next position."""
        batch = token.shape[0]
        at = cache.next[:batch]
        logits = self._run(token.unsqueeze(1), at.view(batch, 1, 1), cache)
        cache.next[:batch] += 1
        last: torch.Tensor = logits[:, -1]
        return last

    def _run(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, positions, cache)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


def init_model(config: ModelConfig, seed: int) -> CausalLM:
    """Random initialisation from `seed`: the same weights on every rank and every run."""
    generator = torch.Generator().manual_seed(seed)
    model = CausalLM(config)
    std = 1.0 / math.sqrt(config.hidden_size)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, std, generator=generator)
    return model


def load_pretrained(directory: Path) -> CausalLM:
    """A model from a local directory: `config.json` plus a state dict (no hub, no pickle code)."""
    config = ModelConfig.from_json(directory / "config.json")
    model = CausalLM(config)
    for name in STATE_DICT_FILES:
        if (directory / name).exists():
            state = torch.load(directory / name, map_location="cpu", weights_only=True)
            missing, unexpected = model.load_state_dict(state, strict=False)
            if config.tie_word_embeddings:
                missing = [m for m in missing if m != "lm_head.weight"]
            if missing or unexpected:
                raise ConfigError(
                    f"{directory / name}: missing {sorted(missing)}, "
                    f"unexpected {sorted(unexpected)}"
                )
            return model
    raise ConfigError(f"{directory} has config.json but no {' or '.join(STATE_DICT_FILES)}")


def save_pretrained(model: CausalLM, directory: Path) -> None:
    """Write `config.json` and `pytorch_model.bin` (the layout `load_pretrained` reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(msgspec.to_builtins(model.config), indent=2))
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
