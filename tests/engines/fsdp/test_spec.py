"""`[engine] trainer = "fsdp"` and `[engine.fsdp]`: typed keys, and clear errors for what cannot
run, at config load."""

from __future__ import annotations

from pathlib import Path

import pytest

from timeshare.config import load_config
from timeshare.errors import ConfigError


def write(tmp_path: Path, engine: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'[engine]\nkind = "torch_ref"\n{engine}')
    return path


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ('trainer = "fsdp"\n[engine.fsdp]\nmodle_dir = "x"\n', r"engine\.fsdp.*modle_dir"),
        ('trainer = "fsdp"\n', r"engine\.fsdp\.model_dir: trainer = \"fsdp\" trains"),
        ('trainer = "deepspeed"\n', r"engine\.trainer"),
        (
            'trainer = "fsdp"\n[engine.fsdp]\nmodel_dir = "m"\nparam_dtype = "float64"\n',
            r"engine\.fsdp\.param_dtype",
        ),
        (
            'trainer = "fsdp"\n[engine.fsdp]\nmodel_dir = "m"\nmicro_batch_size = 7\n',
            r"micro_batch_size \(7\) does not divide a minibatch of 32 samples",
        ),
        (
            'trainer = "fsdp"\n[engine.fsdp]\nmodel_dir = "m"\n'
            '[engine.torch_ref]\nmodel_dir = "n"\n',
            r"engine\.torch_ref\.model_dir: the FSDP trainer's model is engine\.fsdp\.model_dir",
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


def test_the_fsdp_trainer_needs_the_torch_ref_task(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[engine]\nkind = "simulated"\ntrainer = "fsdp"\n')
    with pytest.raises(
        ConfigError, match=r'engine\.trainer = .fsdp. needs engine\.kind = "torch_ref"'
    ):
        load_config(path, environ={})
