"""What the Megatron trainer reads of a transformers config.json: the model's shape, its
architecture's table (names.py), and whether it splits over the tensor-parallel ranks.

No megatron-core here (only torch, through names.py): the export and the config checks read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timeshare.engines.megatron.names import Geometry, Mapped, mapped, table_of
from timeshare.errors import ConfigError

SUPPORTED_ACTIVATIONS = ("silu",)
SUPPORTED_ROPE = ("default", None)


@dataclass(frozen=True)
class HfShape:
    """What the megatron model takes from a transformers config.json."""

    architectures: list[str]
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rms_norm_eps: float
    rope_theta: float
    tied: bool
    where: str

    @classmethod
    def read(cls, model_dir: Path) -> HfShape:
        where = f"engine.megatron.model_dir {model_dir}"
        try:
            config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}: cannot read config.json: {exc}") from exc
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) not in SUPPORTED_ROPE:
            raise ConfigError(f"{where}: rope scaling {rope} (the Megatron trainer: none)")
        if config.get("hidden_act", "silu") not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"{where}: hidden_act {config.get('hidden_act')!r} (only silu)")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            shape = cls(
                architectures=list(config.get("architectures") or []),
                layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                max_positions=int(config.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                tied=bool(config.get("tie_word_embeddings", False)),
                where=where,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}/config.json: {exc!r} missing or not a number") from exc
        table_of(shape.architectures, where)  # one we map
        return shape

    @property
    def qkv_bias(self) -> bool:
        return "Qwen2ForCausalLM" in self.architectures

    def geometry(self, tp: int) -> Geometry:
        return Geometry(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim, tp=tp)

    def params(self) -> list[Mapped]:
        """Every megatron parameter of this model with its HF names, in the model's order."""
        return mapped(table_of(self.architectures, self.where), self.layers, tied=self.tied)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every HF tensor the mapping reads, by name."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, f = self.hidden, self.intermediate
        by_suffix = {
            "embed_tokens.weight": (self.vocab, h),
            "lm_head.weight": (self.vocab, h),
            "norm.weight": (h,),
            "layernorm.weight": (h,),
            "q_proj.weight": (q, h),
            "k_proj.weight": (kv, h),
            "v_proj.weight": (kv, h),
            "q_proj.bias": (q,),
            "k_proj.bias": (kv,),
            "v_proj.bias": (kv,),
            "o_proj.weight": (h, q),
            "gate_proj.weight": (f, h),
            "up_proj.weight": (f, h),
            "down_proj.weight": (h, f),
        }
        shapes = {}
        for param in self.params():
            for name in param.hf:
                suffix = next(s for s in by_suffix if name.endswith(s))
                shapes[name] = by_suffix[suffix]
        return shapes

    def split_problem(self, tp: int) -> str:
        """What does not divide over `tp` tensor-parallel ranks ("": nothing)."""
        for what, size in (
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("intermediate_size", self.intermediate),
            ("vocab_size", self.vocab),
        ):
            if size % tp:
                return (
                    f"engine.megatron.tensor_parallel_size ({tp}) does not divide {what} "
                    f"({size}) of {self.where}"
                )
        return ""
