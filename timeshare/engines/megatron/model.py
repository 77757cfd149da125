"""A megatron-core `GPTModel` of a transformers model directory: its config, its layer spec,
its HF weights loaded into this tensor-parallel rank's shards.

The model directory's config.json says the shape; `names.py` says where each HF tensor goes.
The layer spec is megatron's local one (no Transformer Engine), with RMSNorm, SwiGLU, rotary
positions and no biases but Qwen2's on q, k and v. On a CPU the spec's attention and the
model's rotary embedding are the stand-ins of cpu.py; on GPUs megatron's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from timeshare.engines.megatron import cpu
from timeshare.engines.megatron.names import Geometry, Mapped, local_state, mapped, table_of
from timeshare.engines.model_dir import weight_files
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


def transformer_config(shape: HfShape, tp: int, dtype: torch.dtype) -> TransformerConfig:
    """Megatron's config of the model: the HF shape, split over `tp` ranks, with every fused
    CUDA kernel off (each has a plain-torch path that computes the same)."""
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        use_cpu_initialization=True,  # built on the host, moved to the device after loading
        perform_initialization=False,  # every weight is loaded from the model directory
    )


def build_model(
    shape: HfShape, tp: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> GPTModel:
    """This TP rank's `GPTModel` (empty weights: load them with `load_hf`)."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    on_host = device.type == "cpu"
    if on_host:
        spec.submodules.self_attention.submodules.core_attention = cpu.SdpaAttention
    model = GPTModel(
        config=transformer_config(shape, tp, dtype),
        transformer_layer_spec=spec,
        vocab_size=shape.vocab,
        max_sequence_length=shape.max_positions,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True,  # logits stay split over the vocabulary (vocab-parallel CE)
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
    )
    if on_host:
        cpu.keep_rotary_on_host(model.rotary_pos_emb)
    model = model.to(device)
    with torch.no_grad():
        for parameter in model.parameters():
            # OFFLOAD frees a parameter's storage in place (host_memory.py), which takes
            # resizable storage; some of megatron's host-built parameters are not.
            if not parameter.untyped_storage().resizable():
                parameter.data = parameter.data.clone()
    return model


def read_hf(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors, by HF name (in host memory)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def load_hf(
    model: GPTModel, hf: dict[str, torch.Tensor], shape: HfShape, tp: int, rank: int
) -> None:
    """Copy this TP rank's chunks of the HF tensors into `model`'s parameters."""
    params = shape.params()
    state = local_state(hf, params, shape.geometry(tp), rank)
    own = dict(model.named_parameters())
    unmapped = sorted(set(own) - set(state))
    if unmapped:
        raise ConfigError(f"{shape.where}: megatron parameters with no HF source: {unmapped}")
    with torch.no_grad():
        for name, tensor in state.items():
            target = own[name]
            if target.shape != tensor.shape:
                raise ConfigError(
                    f"{shape.where}: {name} takes {tuple(target.shape)}, the HF tensors give "
                    f"{tuple(tensor.shape)}"
                )
            target.copy_(tensor)
