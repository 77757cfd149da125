"""`timeshare export CHECKPOINT DIR`: a sharded FSDP checkpoint as a transformers directory.

CHECKPOINT is one step's directory (`.../fsdp/step-00000030`) or a job's checkpoint directory
(its newest committed step is taken). The model's tensors are read from DCP's files in this one
process, no process group (`no_dist`), and written as `model.safetensors` beside the config the
step kept, so that `from_pretrained` and vLLM load DIR as they load the model it started from.
A tied head is left out, as transformers writes a tied model.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from pickle import UnpicklingError  # DCP's metadata file; read from disk, never a socket

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from timeshare.engines.fsdp import checkpoint
from timeshare.errors import CheckpointError, ConfigError

MODEL_PREFIX = "model."  # the model's keys in the checkpoint (the optimiser's are beside them)


def is_checkpoint(source: Path) -> bool:
    """Whether `source` is an FSDP step or a job directory holding FSDP steps."""
    return (source / checkpoint.METADATA).is_file() or (source / checkpoint.SUBDIR).is_dir()


def find_step(source: Path) -> Path:
    """The step directory `source` names, or the newest committed step of a job's directory."""
    if (source / checkpoint.METADATA).is_file():
        if not checkpoint.is_committed(source):
            raise ConfigError(f"{source}: this step was never committed (a rank's part is missing)")
        return source
    if not source.is_dir():
        raise ConfigError(f"{source}: no such checkpoint directory")
    committed = checkpoint.committed_step(source)
    if committed is None:
        raise ConfigError(
            f"{source}: no committed FSDP checkpoint (a step directory holds ranks.json, "
            ".metadata and every rank's rank<r>.pt)"
        )
    return checkpoint.step_dir(source, committed)


def export_checkpoint(source: Path, target: Path) -> Path:
    """Write the model of the checkpoint `source` names into `target` (new or empty)."""
    step = find_step(source)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"{target}: exists and is not an empty directory")
    if not (step / "config.json").is_file():
        raise ConfigError(f"{step}: no config.json kept with the checkpoint")
    tensors = _read_model(step)
    if json.loads((step / "config.json").read_text()).get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    target.mkdir(parents=True, exist_ok=True)
    for name in checkpoint.MODEL_FILES:
        if (step / name).is_file():
            shutil.copyfile(step / name, target / name)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return step


def _read_model(step: Path) -> dict[str, torch.Tensor]:
    reader = FileSystemReader(step)
    try:
        metadata = reader.read_metadata().state_dict_metadata
        wanted = {
            key[len(MODEL_PREFIX) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
        }
        if not wanted:
            raise CheckpointError(f"{step}: the checkpoint holds no model tensors")
        with warnings.catch_warnings():  # "assuming ... a single process": it is, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp_load({"model": wanted}, storage_reader=reader, no_dist=True)
    except (OSError, RuntimeError, ValueError, CheckpointException, UnpicklingError) as exc:
        raise CheckpointError(f"cannot read checkpoint {step}: {exc}") from exc
    return wanted
