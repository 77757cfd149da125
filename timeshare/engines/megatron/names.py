"""HF (transformers) weights <-> megatron-core's tensor-parallel parameters, one table per
architecture.

A megatron parameter is made of one or more HF tensors (`Rule.hf`), fused in one of four ways,
and split over the tensor-parallel ranks on one dimension:

    single   one HF tensor; split on its rows (column-parallel layers, the vocab-parallel
             embedding and output layer), its columns (row-parallel layers), or replicated
             (norms)
    qkv      q, k, v (weights or biases) fused by KV group: rank r holds groups
             [r*G/tp, (r+1)*G/tp), each as its query heads' rows, then its k rows, then its v
             rows
    gate_up  gate and up fused per rank: rank r holds [gate rows of r; up rows of r], not a
             contiguous slice of the stacked [gate; up]

Every HF tensor is split on the same dimension as its megatron parameter, so each rank's part
of it is one contiguous chunk: `pieces` takes a rank's local parameter apart into those chunks
(one per HF name, in `Rule.hf` order), `join` puts chunks back together. Loading HF weights
takes each HF tensor's chunk r and joins them; sending gathers each piece over the TP group and
concatenates on `Rule.dim`; an export does the same from every rank's saved parameters.

The names are those of megatron's local layer spec (`get_gpt_layer_local_spec`: norms are their
own modules, not fused into the linear layers as in Transformer Engine's spec).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from timeshare.errors import ConfigError

Fusion = Literal["single", "qkv", "gate_up"]
# The dimension a parameter is split on over the TP ranks (None: each rank holds all of it).
SplitDim = Literal[0, 1] | None


@dataclass(frozen=True)
class Geometry:
    """What the fusions need to know of the model and of the tensor-parallel split."""

    heads: int
    kv_heads: int
    head_dim: int
    tp: int

    @property
    def local_groups(self) -> int:
        return self.kv_heads // self.tp

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Rule:
    megatron: str  # "{i}": the layer's number
    hf: tuple[str, ...]
    fusion: Fusion = "single"
    dim: SplitDim = 0

    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    def named(self, layer: int | None) -> tuple[str, tuple[str, ...]]:
        if layer is None:
            return self.megatron, self.hf
        return self.megatron.format(i=layer), tuple(n.format(i=layer) for n in self.hf)

    # -- a rank's local parameter <-> its chunk of each HF tensor -------------------------------

    def pieces(self, local: torch.Tensor, geometry: Geometry) -> list[torch.Tensor]:
        """This rank's chunk of each HF tensor (views of `local` where they can be)."""
        if self.fusion == "single":
            return [local]
        if self.fusion == "gate_up":
            return list(local.chunk(2, dim=0))
        rest = local.shape[1:]
        per_group = local.view(geometry.local_groups, -1, *rest)
        q_rows = geometry.heads_per_group * geometry.head_dim
        d = geometry.head_dim
        q, k, v = torch.split(per_group, [q_rows, d, d], dim=1)
        return [part.reshape(-1, *rest) for part in (q, k, v)]

    def join(self, pieces: list[torch.Tensor], geometry: Geometry) -> torch.Tensor:
        """The local parameter made of this rank's chunks (the inverse of `pieces`)."""
        if len(pieces) != len(self.hf):
            raise ValueError(f"{self.megatron}: {len(pieces)} pieces for {len(self.hf)} tensors")
        if self.fusion == "single":
            return pieces[0].clone()
        if self.fusion == "gate_up":
            return torch.cat(pieces, dim=0)
        rest = pieces[0].shape[1:]
        groups = geometry.local_groups
        q, k, v = (p.reshape(groups, -1, *rest) for p in pieces)
        return torch.cat((q, k, v), dim=1).reshape(-1, *rest)

    def chunk(self, hf: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """Rank `rank`'s chunk of a whole HF tensor of this rule."""
        if self.dim is None:
            return hf
        size = hf.shape[self.dim]
        if size % tp:
            raise ConfigError(
                f"{self.hf[0]}: dimension {self.dim} ({size}) does not split over "
                f"tensor_parallel_size {tp}"
            )
        return hf.chunk(tp, dim=self.dim)[rank]


def _llama_rules(qkv_bias: bool) -> tuple[Rule, ...]:
    layer = "model.layers.{i}"
    attention = f"{layer}.self_attn"
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule(
            "decoder.layers.{i}.input_layernorm.weight",
            (f"{layer}.input_layernorm.weight",),
            dim=None,
        ),
        Rule(
            "decoder.layers.{i}.self_attention.linear_qkv.weight",
            tuple(f"{attention}.{p}_proj.weight" for p in "qkv"),
            "qkv",
        ),
        Rule(
            "decoder.layers.{i}.self_attention.linear_proj.weight",
            (f"{attention}.o_proj.weight",),
            dim=1,
        ),
        Rule(
            "decoder.layers.{i}.pre_mlp_layernorm.weight",
            (f"{layer}.post_attention_layernorm.weight",),
            dim=None,
        ),
        Rule(
            "decoder.layers.{i}.mlp.linear_fc1.weight",
            (f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight"),
            "gate_up",
        ),
        Rule("decoder.layers.{i}.mlp.linear_fc2.weight", (f"{layer}.mlp.down_proj.weight",), dim=1),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), dim=None),
        Rule("output_layer.weight", ("lm_head.weight",)),
    ]
    if qkv_bias:
        rules.append(
            Rule(
                "decoder.layers.{i}.self_attention.linear_qkv.bias",
                tuple(f"{attention}.{p}_proj.bias" for p in "qkv"),
                "qkv",
            )
        )
    return tuple(rules)


# transformers' architecture name -> its table. Qwen2 is Llama with biases on q, k and v.
TABLES: dict[str, tuple[Rule, ...]] = {
    "LlamaForCausalLM": _llama_rules(qkv_bias=False),
    "Qwen2ForCausalLM": _llama_rules(qkv_bias=True),
}


def table_of(architectures: list[str], where: str) -> tuple[Rule, ...]:
    """The table of a model's `architectures`; a `ConfigError` naming the ones known."""
    for name in architectures:
        if name in TABLES:
            return TABLES[name]
    raise ConfigError(
        f"{where}: architectures {architectures}: the Megatron trainer maps "
        f"{', '.join(sorted(TABLES))}"
    )


@dataclass(frozen=True)
class Mapped:
    """One megatron parameter of the model, with its rule and HF names."""

    megatron: str
    hf: tuple[str, ...]
    rule: Rule


def mapped(table: tuple[Rule, ...], layers: int, *, tied: bool) -> list[Mapped]:
    """Every parameter of a model of `layers` layers under `table`, in the model's own order
    (embedding, each layer, final norm, head): the order SYNC sends in. A tied head is the
    embedding's parameter: it has no entry of its own."""
    out: list[Mapped] = []
    layer_rules = [r for r in table if r.per_layer()]
    for rule in table:
        if rule.megatron == "output_layer.weight" and tied:
            continue
        if rule.per_layer():
            if rule is layer_rules[0]:
                for i in range(layers):
                    out += [Mapped(*r.named(i), r) for r in layer_rules]
            continue
        out.append(Mapped(*rule.named(None), rule))
    return out


def local_state(
    hf: Mapping[str, torch.Tensor], params: list[Mapped], geometry: Geometry, rank: int
) -> dict[str, torch.Tensor]:
    """TP rank `rank`'s parameters, by megatron name, from whole HF tensors."""
    state = {}
    for param in params:
        missing = [name for name in param.hf if name not in hf]
        if missing:
            raise ConfigError(f"no tensor {missing[0]} in the model's weights ({param.megatron})")
        chunks = [param.rule.chunk(hf[name], rank, geometry.tp) for name in param.hf]
        state[param.megatron] = param.rule.join(chunks, geometry)
    return state


def hf_state(
    locals_by_rank: Sequence[Mapping[str, torch.Tensor]], params: list[Mapped], geometry: Geometry
) -> dict[str, torch.Tensor]:
    """Whole HF tensors, by HF name, from every TP rank's parameters (rank order)."""
    out = {}
    for param in params:
        per_rank = [param.rule.pieces(local[param.megatron], geometry) for local in locals_by_rank]
        for index, name in enumerate(param.hf):
            chunks = [pieces[index] for pieces in per_rank]
            dim = param.rule.dim
            out[name] = chunks[0].clone() if dim is None else torch.cat(chunks, dim=dim)
    return out
