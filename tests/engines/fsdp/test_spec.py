"""`[engine] trainer = "fsdp"` and `[engine.fsdp]`: typed keys, and clear errors for what cannot
run, at config load."""

from __future__ import annotations

from pathlib import Path

import pytest

from timeshare.config import load_config
from timeshare.engines.fsdp import check
from timeshare.errors import ConfigError


def write(tmp_path: Path, engine: str) -> Path:
    """`engine` in `[engine]`, the reference rollout serving the trainer."""
    path = tmp_path / "job.toml"
    path.write_text(f'[engine]\nrollout = "torch_ref"\n{engine}')
    return path


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ('trainer = "fsdp"\n[engine.fsdp]\nmodle_dir = "x"\n', r"engine\.fsdp.*modle_dir"),
        ('trainer = "fsdp"\n', r"engine\.fsdp\.model_dir: trainer = \"fsdp\" trains"),
        ('trainer = "deepspeed"\n', r"engine\.trainer = 'deepspeed': no such engine"),
        (
            'trainer = "fsdp"\n[engine.fsdp]\nmodel_dir = "m"\nparam_dtype = "float64"\n',
            r"engine\.fsdp\.param_dtype",
        ),
        (
            'trainer = "fsdp"\n[engine.fsdp]\nmodel_dir = "m"\nmicro_batch_size = 7\n',
            r"micro_batch_size \(7\) does not divide a minibatch of 32 samples",
        ),
        (
            'trainer = "fsdp"\n[engine.fsdp]\nmodel_dir = "/nonexistent/model"\n',
            r"engine\.fsdp\.model_dir: /nonexistent/model is not a directory",
        ),
    ],
)
def test_what_cannot_run_is_one_error_naming_the_key(
    tmp_path: Path, engine: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, engine), environ={})


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ('[engine.torch_ref]\nmodel_dir = "n"\n', "model_dir"),
        ("[engine.torch_ref.model]\nhidden_size = 128\n", "model"),
    ],
)
def test_the_fsdp_trainers_model_is_its_model_dir_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str, key: str
) -> None:
    # Whatever transformers says of the directory (a child process: test_model_check.py).
    monkeypatch.setattr(check, "check_model_dir", lambda model_dir: None)
    engine = f'trainer = "fsdp"\n[engine.fsdp]\nmodel_dir = "m"\n{section}'
    with pytest.raises(
        ConfigError,
        match=rf"engine\.torch_ref\.{key}: the rollout serves the trainer's model "
        r"\(engine\.trainer = 'fsdp'\); leave it unset",
    ):
        load_config(write(tmp_path, engine), environ={})


def test_the_fsdp_trainer_needs_a_rollout_that_serves_its_model(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[engine]\nrollout = "simulated"\ntrainer = "fsdp"\n')
    with pytest.raises(
        ConfigError,
        match=r"engine\.trainer = 'fsdp' \(from file .*\) and engine\.rollout = 'simulated' "
        r"\(from file .*\) do not pair",
    ):
        load_config(path, environ={})
