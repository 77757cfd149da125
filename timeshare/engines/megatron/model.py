"""A megatron-core `GPTModel` of a transformers model directory: its config, its layer spec,
its HF weights loaded into this tensor-parallel rank's shards.

The model directory's config.json says the shape; `names.py` says where each HF tensor goes.
The layer spec is megatron's local one (no Transformer Engine), with RMSNorm, SwiGLU, rotary
positions and no biases but Qwen2's on q, k and v. On a CPU the spec's attention and the
model's rotary embedding are the stand-ins of cpu.py; on GPUs megatron's own.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig
from timeshare.engines.megatron import cpu
from timeshare.engines.megatron.hf_config import HfShape
from timeshare.engines.megatron.names import local_state
from timeshare.engines.model_dir import weight_files
from timeshare.errors import ConfigError


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
    shape: HfShape,
    tp: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    batch_invariant: bool = False,
) -> GPTModel:
    """This TP rank's `GPTModel` (empty weights: load them with `load_hf`); `batch_invariant`:
    its attention in that mode (engines/invariance.py; a CPU's alone)."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    on_host = device.type == "cpu"
    if on_host:
        attention = cpu.RowLocalAttention if batch_invariant else cpu.SdpaAttention
        spec.submodules.self_attention.submodules.core_attention = attention
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
        rotary_base=shape.rope_theta,  # (megatron only raises it to a power)
    )
    if on_host:
        cpu.keep_rotary_on_host(model.rotary_pos_emb)
    model = model.to(device)
    mark_split_parameters(model, shape)
    with torch.no_grad():
        for parameter in model.parameters():
            # OFFLOAD frees a parameter's storage in place (host_memory.py), which takes
            # resizable storage; some of megatron's host-built parameters are not.
            if not parameter.untyped_storage().resizable():
                parameter.data = parameter.data.clone()
    return model


def mark_split_parameters(model: GPTModel, shape: HfShape) -> None:
    """Mark every parameter split over the TP ranks as megatron does when it initialises one
    (`tensor_model_parallel`, `partition_dim`): built on the host without initialisation
    (the weights are loaded), megatron leaves them unmarked, and gradient clipping reads the
    mark to count a replicated parameter once."""
    own = dict(model.named_parameters())
    for param in shape.params():
        tensor = own[param.megatron]
        # (a bias megatron marks either way, and every weight built on a GPU, are marked)
        if param.rule.dim is not None and not hasattr(tensor, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(tensor, True, param.rule.dim, 1)


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
