"""A model's sizes from its transformers `config.json` alone: no weights, no transformers.

Counted exactly for decoder-only transformers with grouped-query attention (Llama, Qwen2/3,
Mistral, GLM-4) and their mixture-of-experts kin (Mixtral, Qwen2/3-MoE, GLM-4-MoE, DeepSeek's
MoE layout with dense first layers and shared experts): embeddings, attention (biases where the
config says so), MLP or experts (routed, shared, the router), norms, and the head unless tied.
Multi-head latent attention (DeepSeek-V2/V3's `kv_lora_rank`) is not counted: a clear error,
not a wrong number.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from timeshare.engines.footprint import DTYPE_BYTES
from timeshare.engines.model_config import read_config_json
from timeshare.errors import ConfigError

# Families whose attention projections carry biases without saying so in the config.
QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe"})


class ModelSize(NamedTuple):
    architecture: str
    parameters: int  # every parameter
    active_parameters: int  # those one token passes through (MoE: the chosen experts only)
    largest_layer: int  # parameters of the largest decoder layer
    largest_tensor: int  # elements of the largest single tensor (the embedding, mostly)
    edge: int  # embeddings, final norm and head: outside every decoder layer
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_active: int  # intermediate width one token passes through (MoE: k experts + shared)
    max_positions: int
    dtype_bytes: int | None  # the config's own torch_dtype; None: unstated

    def kv_bytes_per_token(self, element_bytes: int, tensor_parallel: int = 1) -> int:
        """Keys and values of one token on one rank of a tensor-parallel group (kv heads
        fewer than the group are replicated, as vLLM does)."""
        per_rank = max(1, self.kv_heads // tensor_parallel)
        return 2 * self.layers * per_rank * self.head_dim * element_bytes


def model_size_of(path: Path) -> ModelSize:
    """The sizes of the model whose `config.json` is `path`; a ConfigError naming the key a
    count needs and the file does not give."""
    return count(read_config_json(path), str(path))


def count(config: Mapping[str, Any], where: str) -> ModelSize:
    read = _Reader(config, where)
    if "kv_lora_rank" in config:
        raise ConfigError(
            f"{where}: kv_lora_rank: multi-head latent attention is not counted by `timeshare "
            "plan` yet (grouped-query attention is)"
        )
    hidden, layers, vocab = (
        read.number("hidden_size"),
        read.number("num_hidden_layers"),
        read.number("vocab_size"),
    )
    heads = read.number("num_attention_heads")
    kv_heads = read.number("num_key_value_heads", heads)
    head_dim = read.number("head_dim", hidden // heads)
    bias = bool(config.get("attention_bias", config.get("model_type") in QKV_BIAS_TYPES))
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    if bias:
        attention += head_dim * (heads + 2 * kv_heads)
    norms = 2 * hidden
    mlps = _mlps(read, hidden, layers)
    per_layer = [attention + norms + mlp.parameters for mlp in mlps]
    embedding = vocab * hidden
    head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    edge = embedding + hidden + head
    return ModelSize(
        architecture=_architecture(config),
        parameters=sum(per_layer) + edge,
        active_parameters=sum(attention + norms + mlp.active for mlp in mlps) + edge,
        largest_layer=max(per_layer),
        largest_tensor=max(
            embedding, *(mlp.largest_tensor for mlp in mlps), hidden * head_dim * heads
        ),
        edge=edge,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        mlp_active=max(mlp.active_width for mlp in mlps),
        max_positions=read.number("max_position_embeddings", 0),
        dtype_bytes=DTYPE_BYTES.get(str(config.get("torch_dtype", config.get("dtype", "")))),
    )


class _Mlp(NamedTuple):
    parameters: int
    active: int  # parameters one token passes through
    active_width: int  # intermediate width one token passes through
    largest_tensor: int


def _mlps(read: _Reader, hidden: int, layers: int) -> list[_Mlp]:
    """Each decoder layer's MLP: dense, or experts (routed, shared, and their router)."""
    dense_width = read.number("intermediate_size", 0)
    dense = _Mlp(
        3 * hidden * dense_width, 3 * hidden * dense_width, dense_width, hidden * dense_width
    )
    experts = read.first_number(("num_experts", "n_routed_experts", "num_local_experts"), 0)
    if not experts:
        if not dense_width:
            raise ConfigError(f"{read.where}: no intermediate_size: the MLP cannot be counted")
        return [dense] * layers
    width = read.number("moe_intermediate_size", dense_width)
    chosen = read.number("num_experts_per_tok")
    shared_width = read.number("n_shared_experts", 0) * width + read.number(
        "shared_expert_intermediate_size", 0
    )
    router = hidden * experts + (hidden if read.number("shared_expert_intermediate_size", 0) else 0)
    expert = 3 * hidden * width
    sparse = _Mlp(
        parameters=experts * expert + 3 * hidden * shared_width + router,
        active=chosen * expert + 3 * hidden * shared_width + router,
        active_width=chosen * width + shared_width,
        largest_tensor=hidden * max(width, shared_width),
    )
    return [sparse if _is_sparse(read, index) else dense for index in range(layers)]


def _is_sparse(read: _Reader, layer: int) -> bool:
    """Whether decoder layer `layer` has experts: DeepSeek/GLM's first_k_dense_replace, Qwen's
    mlp_only_layers and decoder_sparse_step."""
    if layer < read.number("first_k_dense_replace", 0):
        return False
    if layer in (read.config.get("mlp_only_layers") or []):
        return False
    step = read.number("decoder_sparse_step", 1)
    return step > 0 and (layer + 1) % step == 0


def _architecture(config: Mapping[str, Any]) -> str:
    names = config.get("architectures")
    if isinstance(names, list) and names:
        return str(names[0])
    return str(config.get("model_type", "unknown"))


class _Reader:
    """Integer keys of a config, each error naming the file and the key."""

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        self.config = config
        self.where = where

    def number(self, key: str, default: int | None = None) -> int:
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"{self.where}: no {key}: the model cannot be counted")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{self.where}: {key} = {value!r} is not a count")
        return value

    def first_number(self, keys: tuple[str, ...], default: int) -> int:
        for key in keys:
            if self.config.get(key) is not None:
                return self.number(key)
        return default
