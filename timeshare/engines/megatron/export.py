"""`timeshare export CHECKPOINT DIR` of a Megatron checkpoint: a transformers directory.

CHECKPOINT is one step's directory (`.../megatron/step-00000030`) or a job's checkpoint
directory (its newest committed step is taken). Every TP rank's shards (`tp<t>.pt`) are read in
this one process, put back together into HF tensors by the same tables SYNC uses (names.py),
and written as `model.safetensors` beside the config the step kept, so that `from_pretrained`
and vLLM load DIR as they load the model the job started from. A tied head is the embedding's:
it is not written, as transformers writes a tied model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from timeshare.engines.megatron import checkpoint
from timeshare.engines.megatron.hf_config import HfShape
from timeshare.engines.megatron.names import hf_state
from timeshare.errors import CheckpointError, ConfigError


def is_checkpoint(source: Path) -> bool:
    """Whether `source` is a Megatron step or a job directory holding Megatron steps."""
    return (source / checkpoint.LAYOUT_FILE).is_file() or (source / checkpoint.SUBDIR).is_dir()


def find_step(source: Path) -> Path:
    """The step directory `source` names, or the newest committed step of a job's directory."""
    if (source / checkpoint.LAYOUT_FILE).is_file():
        if not checkpoint.is_committed(source):
            raise ConfigError(f"{source}: this step was never committed (a rank's part is missing)")
        return source
    committed = checkpoint.committed_step(source)
    if committed is None:
        raise ConfigError(
            f"{source}: no committed Megatron checkpoint (a step directory holds layout.json, "
            "every TP rank's tp<t>.pt and every rank's rank<r>.pt)"
        )
    return checkpoint.step_dir(source, committed)


def export_checkpoint(source: Path, target: Path) -> Path:
    """Write the model of the checkpoint `source` names into `target` (new or empty)."""
    step = find_step(source)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"{target}: exists and is not an empty directory")
    if not (step / "config.json").is_file():
        raise ConfigError(f"{step}: no config.json kept with the checkpoint")
    shape = HfShape.read(step)
    layout = checkpoint.layout_of(step)
    assert layout is not None, "a committed step has its layout"
    _, tp = layout
    shards = []
    for tp_rank in range(tp):
        path = checkpoint.shard_file(step, tp_rank)
        try:
            shards.append(torch.load(path, weights_only=True, map_location="cpu")["model"])
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    tensors = hf_state(shards, shape.params(), shape.geometry(tp))
    target.mkdir(parents=True, exist_ok=True)
    for name in checkpoint.MODEL_FILES:
        if (step / name).is_file():
            shutil.copyfile(step / name, target / name)
    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    save_file(contiguous, str(target / "model.safetensors"), metadata={"format": "pt"})
    return step
