"""Sharded checkpoints of the FSDP trainer (`torch.distributed.checkpoint`), and their commit.

One step is one directory, `<job checkpoint dir>/fsdp/step-<k>/`, written by all ranks together:

    ranks.json                  how many ranks write the step (written first, by rank 0)
    .metadata, __<r>_0.distcp   DCP's files: the model and optimiser state, each rank its shards
    config.json                 the model's transformers config (what `timeshare export` needs)
    rank<r>.pt                  rank r's own state (step, RNG, the TRAIN's metrics), written last

DCP writes and fsyncs every rank's shards, then the coordinator writes `.metadata`, and
`dcp.save` returns on every rank only after that. Each rank then writes its `rank<r>.pt`
atomically (temporary file, fsync, rename, fsync of the directory): it says "my part of this
step is durable". A step is committed when `.metadata` and the file of every rank `ranks.json`
names are there, the same rule as the reference trainer's (a step is committed only when every
rank's checkpoint is durable). A step redone after a crash is removed first, by rank 0, behind a
barrier. DCP reports its failures as `CheckpointException`, a BaseException: they are turned into
`CheckpointError` here, so that a worker reports them as any other failure.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from timeshare.durable import fsync_directory, write_atomically
from timeshare.engines import step_dirs
from timeshare.errors import CheckpointError
from timeshare.task.files import GENERATION_CONFIG, TOKENIZER_FILES

SUBDIR = "fsdp"
METADATA = ".metadata"
RANKS_FILE = "ranks.json"
# What a step keeps of the model directory beside its weights, so that an export of it is a
# whole model directory again: its config and its tokenizer (a job reads both from there)
MODEL_FILES = ("config.json", GENERATION_CONFIG, *TOKENIZER_FILES)


def step_dir(root: Path, step: int) -> Path:
    return step_dirs.step_dir(root, SUBDIR, step)


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pt"


def is_committed(directory: Path) -> bool:
    """Every rank's part of the step in `directory` is durable."""
    ranks = ranks_of(directory)
    if ranks is None or not (directory / METADATA).is_file():
        return False
    return all(rank_file(directory, r).is_file() for r in range(ranks))


def ranks_of(directory: Path) -> int | None:
    """How many ranks write the step in `directory` (None: not known, the step is not whole)."""
    try:
        ranks = json.loads((directory / RANKS_FILE).read_text())["ranks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ranks if isinstance(ranks, int) and ranks > 0 else None


def steps(root: Path) -> list[int]:
    """Every step with a directory (committed or not), oldest first."""
    return step_dirs.steps(root, SUBDIR)


def committed_step(root: Path) -> int | None:
    """The newest step every rank that wrote it holds durably (None: none yet)."""
    return step_dirs.committed_step(root, SUBDIR, is_committed)


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    own: dict[str, Any],
    *,
    rank: int,
    ranks: int,
    model_dir: Path,
    keep: int = step_dirs.KEEP,
) -> Path:
    """Write `step` with every rank (a collective); return once this rank's part is durable."""
    directory = step_dir(root, step)
    try:
        if rank == 0:
            _start_step(directory, ranks, model_dir)
        if ranks > 1:
            dist.barrier()  # nobody writes into the directory before it is clean
        model_state, optimizer_state = get_state_dict(model, optimizer)
        writer = FileSystemWriter(directory, sync_files=True)
        dcp_save({"model": model_state, "optimizer": optimizer_state}, storage_writer=writer)
        step_dirs.write_durably(rank_file(directory, rank), own)
        if rank == 0:
            fsync_directory(directory)
    except (OSError, CheckpointException) as exc:
        raise CheckpointError(f"cannot write checkpoint {directory}: {exc}") from exc
    if rank == 0:
        step_dirs.prune(root, SUBDIR, is_committed, keep)
    return directory


def _start_step(directory: Path, ranks: int, model_dir: Path) -> None:
    """A clean directory for the step (one redone after a crash starts anew), its rank count
    and the model's config, durable before any rank writes into it."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    fsync_directory(directory.parent)
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, directory / name)
    write_atomically(directory / RANKS_FILE, json.dumps({"ranks": ranks}).encode())


def check_ranks(directory: Path, ranks: int, *, fewer_allowed: bool) -> int:
    """The ranks that wrote the step in `directory`: this job's, or more when `fewer_allowed`
    ([cluster] min_nodes: DCP reshards the model and AdamW on load). Never resumed silently."""
    written = ranks_of(directory)
    if written is None or written == ranks:
        return ranks
    if written > ranks and not fewer_allowed:
        raise CheckpointError(
            f"{directory} was written by {written} ranks; this job has {ranks}: set [cluster] "
            "min_nodes to resume a job on fewer nodes (its checkpoint is then resharded)"
        )
    if written < ranks:
        raise CheckpointError(
            f"{directory} was written by {written} ranks; this job has {ranks} (a checkpoint "
            "is resharded to fewer ranks, not to more: start from an export)"
        )
    return written


def load(
    root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int
) -> dict[str, Any]:
    """Load `step` into `model` and `optimizer` (a collective); return this rank's own state."""
    directory = step_dir(root, step)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp_load(
            {"model": model_state, "optimizer": optimizer_state},
            storage_reader=FileSystemReader(directory),
        )
        own: dict[str, Any] = torch.load(rank_file(directory, rank), weights_only=True)
    except (OSError, RuntimeError, ValueError, CheckpointException) as exc:
        raise CheckpointError(f"cannot read checkpoint {directory}: {exc}") from exc
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
    )
    return own
