"""Parameter counts from config.json alone, against the published sizes of real models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from timeshare.capacity.model_size import count, model_size_of
from timeshare.errors import ConfigError

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "tie_word_embeddings": False,
}
QWEN2_7B: dict[str, Any] = {
    "model_type": "qwen2",  # q, k and v carry biases without the config saying so
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
}
MIXTRAL_8X7B: dict[str, Any] = {
    **LLAMA3_8B,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def test_dense_models_are_counted_to_the_parameter() -> None:
    assert count(LLAMA3_8B, "llama").parameters == 8_030_261_248
    assert count(QWEN2_7B, "qwen2").parameters == 7_615_616_512


def test_tied_embeddings_are_counted_once() -> None:
    tied = count({**LLAMA3_8B, "tie_word_embeddings": True}, "tied")
    assert count(LLAMA3_8B, "untied").parameters - tied.parameters == 128256 * 4096


def test_experts_count_whole_and_active_per_token() -> None:
    mixtral = count(MIXTRAL_8X7B, "mixtral")
    assert round(mixtral.parameters / 1e9, 1) == 46.7  # "Mixtral 8x7B: 46.7B total"
    assert round(mixtral.active_parameters / 1e9, 1) == 12.9  # "12.9B active"


def test_the_moe_recipe_has_the_size_of_qwen3_235b_a22b() -> None:
    recipe = Path(__file__).parents[2] / "examples/recipes/moe-235b-32-nodes/model/config.json"
    size = model_size_of(recipe)
    assert round(size.parameters / 1e9) == 235
    assert round(size.active_parameters / 1e9) == 22
    assert size.kv_bytes_per_token(2, tensor_parallel=8) == 2 * 94 * 1 * 128 * 2  # replicated


def test_dense_first_layers_and_shared_experts_are_counted() -> None:
    moe = {
        **LLAMA3_8B,
        "n_routed_experts": 4,
        "moe_intermediate_size": 1024,
        "num_experts_per_tok": 2,
    }
    with_dense = count({**moe, "first_k_dense_replace": 2, "n_shared_experts": 1}, "deepseek-like")
    all_sparse = count(moe, "sparse")
    expert, dense = 3 * 4096 * 1024, 3 * 4096 * 14336
    router = 4096 * 4
    shared_on_sparse_layers = 30 * expert  # one shared expert on each of the 30 sparse layers
    dense_not_sparse = 2 * (dense - 4 * expert - router)  # the first two layers
    assert (
        with_dense.parameters - all_sparse.parameters == shared_on_sparse_layers + dense_not_sparse
    )


def test_what_cannot_be_counted_is_an_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        count({**LLAMA3_8B, "kv_lora_rank": 512}, "deepseek")
    with pytest.raises(ConfigError, match=r"cfg\.json: no hidden_size"):
        count({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}, "cfg.json")
    with pytest.raises(ConfigError, match="num_hidden_layers = '32' is not a count"):
        count({**LLAMA3_8B, "num_hidden_layers": "32"}, "cfg.json")
