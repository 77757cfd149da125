"""A model directory the FSDP trainer cannot load is refused at config load, naming the path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from timeshare.engines.fsdp.check import check_model_dir, model_dir_problem
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.torch_ref.spec import servable
from timeshare.errors import ConfigError

SHAPE = ModelShape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=4, vocab=16)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("check") / "llama", SHAPE, seed=0)


def broken_copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "model"))


def edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(directory: Path, drop: str = "", add: str = "") -> None:
    tensors = load_file(directory / "model.safetensors")
    if drop:
        tensors.pop(drop)
    if add:
        tensors[add] = tensors["model.norm.weight"].clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_a_model_made_by_model_init_passes(good: Path) -> None:
    assert model_dir_problem(good) == ""
    check_model_dir(str(good))  # the same, asked of a child process


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (shutil.rmtree, "is not a directory"),
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: (d / "config.json").write_text("{"), "config.json: transformers cannot read"),
        (lambda d: edit_config(d, model_type="frobnicator"), "does not recognize"),
        (
            lambda d: edit_config(d, architectures=["FrobForCausalLM"]),
            "has no architecture 'FrobForCausalLM'",
        ),
        (lambda d: (d / "model.safetensors").unlink(), "has no *.safetensors weights"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 16), "cannot read"),
        (
            lambda d: edit_tensors(d, drop="model.layers.1.mlp.up_proj.weight"),
            "1 tensors missing from its weights: model.layers.1.mlp.up_proj.weight",
        ),
        (
            lambda d: edit_tensors(d, add="model.layers.9.extra.weight"),
            "tensors the model does not have: model.layers.9.extra.weight",
        ),
        (lambda d: edit_config(d, hidden_size=64, head_dim=16), "tensors of the wrong shape"),
    ],
)
def test_a_bad_model_dir_is_named_with_what_is_wrong(
    good: Path, tmp_path: Path, damage: object, expected: str
) -> None:
    directory = broken_copy(good, tmp_path)
    assert callable(damage)
    damage(directory)
    problem = model_dir_problem(directory)
    assert problem.startswith(f"engine.fsdp.model_dir: {directory}"), problem
    assert expected in problem, problem


def test_the_child_process_check_raises_the_problem(good: Path, tmp_path: Path) -> None:
    directory = broken_copy(good, tmp_path)
    (directory / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        check_model_dir(str(directory))


def test_the_reference_rollout_serves_a_llama_and_refuses_a_qwen2(
    good: Path, tmp_path: Path
) -> None:
    config = servable(good)
    assert (config.hidden_size, config.num_key_value_heads) == (32, 4)
    qwen = init_model_dir(tmp_path / "qwen", ModelShape(**{**SHAPE.__dict__, "arch": "qwen2"}), 0)
    with pytest.raises(ConfigError, match=r"serves the Llama architecture only .*Qwen2ForCausalLM"):
        servable(qwen)


def test_rope_theta_is_read_where_transformers_5_keeps_it(good: Path, tmp_path: Path) -> None:
    directory = broken_copy(good, tmp_path)
    edit_config(directory, rope_parameters={"rope_theta": 5000.0, "rope_type": "default"})
    assert ModelConfig.from_json(directory / "config.json").rope_theta == 5000.0
