"""The HF <-> megatron tables: loading and gathering back are exact inverses, and the fused
layouts are megatron's (the numbers against transformers' logits are test_trainer.py's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from timeshare.engines.megatron.hf_config import HfShape
from timeshare.engines.megatron.names import Geometry, hf_state, local_state
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.errors import ConfigError

SHAPES = {
    "llama": ModelShape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=16),
    "qwen2": ModelShape(
        arch="qwen2", layers=2, hidden=32, intermediate=64, heads=8, kv_heads=4, vocab=16
    ),
    "tied": ModelShape(
        layers=1, hidden=32, intermediate=64, heads=4, kv_heads=4, vocab=16, tie_embeddings=True
    ),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name: str = request.param
    return init_model_dir(tmp_path_factory.mktemp(name) / "model", SHAPES[name], seed=1)


def hf_tensors(model: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(model / "model.safetensors")
    if json.loads((model / "config.json").read_text()).get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return tensors


def test_split_then_gathered_is_the_model_bit_for_bit(model: Path) -> None:
    shape = HfShape.read(model)
    hf = hf_tensors(model)
    params = shape.params()
    splits = [tp for tp in (1, 2, 4) if not shape.split_problem(tp)]
    assert splits[:2] == [1, 2]
    for tp in splits:
        geometry = shape.geometry(tp)
        shards = [local_state(hf, params, geometry, rank) for rank in range(tp)]
        back = hf_state(shards, params, geometry)
        assert back.keys() == hf.keys()
        assert all(back[name].equal(hf[name]) for name in hf), f"tp {tp}"


def test_qkv_is_grouped_by_kv_group_and_gate_up_stacked_per_rank(model: Path) -> None:
    shape = HfShape.read(model)
    hf = hf_tensors(model)
    geometry = shape.geometry(2)
    rank1 = local_state(hf, shape.params(), geometry, 1)
    d, per_group = shape.head_dim, shape.heads // shape.kv_heads
    prefix = "model.layers.0"
    q, k, v = (hf[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv")
    # rank 1's first KV group is group G/2: its query heads, its k rows, its v rows
    group = shape.kv_heads // 2
    expected_first = torch.cat(
        (
            q[group * per_group * d : (group + 1) * per_group * d],
            k[group * d : (group + 1) * d],
            v[group * d : (group + 1) * d],
        )
    )
    qkv = rank1["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] == (per_group + 2) * d * shape.kv_heads // 2
    assert qkv[: len(expected_first)].equal(expected_first)
    gate, up = (hf[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    half = shape.intermediate // 2
    assert rank1["decoder.layers.0.mlp.linear_fc1.weight"].equal(
        torch.cat((gate[half:], up[half:]))
    )
    assert rank1["decoder.layers.0.mlp.linear_fc2.weight"].equal(
        hf[f"{prefix}.mlp.down_proj.weight"][:, half:]
    )


def test_a_tied_head_has_no_parameter_of_its_own(model: Path) -> None:
    shape = HfShape.read(model)
    names = {p.megatron for p in shape.params()}
    assert ("output_layer.weight" in names) == (not shape.tied)


def test_what_does_not_split_or_map_is_named(model: Path, tmp_path: Path) -> None:
    shape = HfShape.read(model)
    assert "does not divide" in shape.split_problem(shape.kv_heads * 2)
    config = json.loads((model / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "architectures": ["MistralForCausalLM"]})
    )
    with pytest.raises(ConfigError, match=r"MistralForCausalLM.*LlamaForCausalLM"):
        HfShape.read(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    )
    with pytest.raises(ConfigError, match="rope scaling"):
        HfShape.read(tmp_path)


def test_missing_hf_tensors_are_named(model: Path) -> None:
    shape = HfShape.read(model)
    hf = hf_tensors(model)
    del hf["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ConfigError, match=re.escape("model.layers.0.mlp.up_proj.weight")):
        local_state(hf, shape.params(), Geometry(shape.heads, shape.kv_heads, shape.head_dim, 1), 0)
