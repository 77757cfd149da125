"""`timeshare model init`: a transformers model directory from a seed, offline, reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.errors import ConfigError
from timeshare.task.vocab import BOS, EOS, PAD, SEP

SMALL = ModelShape(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=32)


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


@pytest.mark.parametrize(
    ("arch", "model_class"), [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]
)
def test_a_model_from_a_seed_loads_with_transformers_and_is_the_same_every_time(
    tmp_path: Path, arch: str, model_class: str
) -> None:
    shape = ModelShape(**{**SMALL.__dict__, "arch": arch})
    torch.manual_seed(1234)
    before = torch.rand(3)
    first = init_model_dir(tmp_path / "a", shape, seed=7)
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(3), before)  # the caller's RNG is untouched
    again = init_model_dir(tmp_path / "b", shape, seed=7)
    other = init_model_dir(tmp_path / "c", shape, seed=8)
    a, b, c = tensors(first), tensors(again), tensors(other)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "norm" not in k)
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == [model_class]
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (64, 2, 16)
    model = transformers.AutoModelForCausalLM.from_pretrained(first)
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[k], a[k]) for k in a)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 32)


def test_tied_embeddings_are_one_tensor(tmp_path: Path) -> None:
    tied = init_model_dir(
        tmp_path / "t", ModelShape(**{**SMALL.__dict__, "tie_embeddings": True}), 0
    )
    assert "lm_head.weight" not in tensors(tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(tied)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"hidden": 65}, "--hidden (65) is not a multiple of --heads (4)"),
        ({"heads": 4, "kv_heads": 3}, "--heads (4) is not a multiple of --kv-heads (3)"),
        ({"layers": 0}, "--layers must be at least 1"),
    ],
)
def test_a_shape_no_model_can_have_is_refused_naming_the_flag(
    tmp_path: Path, changes: dict[str, int], named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        init_model_dir(tmp_path / "m", ModelShape(**{**SMALL.__dict__, **changes}), 0)
    assert not (tmp_path / "m").exists()


def test_the_command_writes_a_model_and_refuses_bad_input_with_exit_2(tmp_path: Path) -> None:
    def init(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "timeshare", "model", "init", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)

    done = init("--arch", "qwen2", "--layers", "1", "--hidden", "32", str(tmp_path / "q"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "q" / "config.json").read_text())["num_hidden_layers"] == 1
    again = init(str(tmp_path / "q"))  # not empty: never overwritten
    assert again.returncode == 2 and "is not an empty directory" in again.stderr
    unknown = init("--arch", "gpt9", str(tmp_path / "x"))
    assert unknown.returncode == 2 and "--arch" in unknown.stderr
    assert not (tmp_path / "x").exists()


def test_the_directory_holds_the_digit_tokenizer_and_its_ids_everywhere(tmp_path: Path) -> None:
    model_dir = init_model_dir(tmp_path / "m", SMALL, seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    special = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert special == (BOS, EOS, PAD)
    for name in ("config.json", "generation_config.json"):
        values = json.loads((model_dir / name).read_text())
        assert (values["bos_token_id"], values["eos_token_id"], values["pad_token_id"]) == special
    generation = transformers.GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    assert generation.eos_token_id == EOS  # not transformers' Llama default (2: a digit)
    chat = [{"role": "user", "content": "7 7"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(text, add_special_tokens=False) == [BOS, 7, 7, SEP]
    assert len(tokenizer) <= SMALL.vocab
    with pytest.raises(ConfigError, match=r"--vocab \(14\) is smaller than the digit task's"):
        init_model_dir(tmp_path / "v", ModelShape(**{**SMALL.__dict__, "vocab": 14}), 0)
