"""Sharded checkpoints of the Megatron trainer, and their commit.

One step is one directory, `<job checkpoint dir>/megatron/step-<k>/`:

    layout.json     the ranks and the tensor-parallel size that wrote it (written first, by
                    rank 0, with the model's config.json beside it)
    tp<t>.pt        TP rank t's shards: the model's parameters by megatron name and the
                    optimiser's state, written by the first data-parallel replica alone (every
                    replica holds the same)
    rank<r>.pt      rank r's own state (step, RNG, the TRAIN's metrics)

Each file is written atomically and durably (temporary file, fsync, rename, fsync of the
directory): its presence says that part of the step is durable. A step is committed when
layout.json and every tp<t>.pt and rank<r>.pt it names are there, the rule of every trainer
here (a step is committed only when every rank's part is durable). A step redone after a crash
is removed first, by rank 0, behind a barrier.

On a CPU a job may resume with another number of data-parallel replicas (ranks), as long as
the tensor-parallel size is the one that wrote the step: every rank reads its TP rank's shards;
a rank that did not exist then starts its own RNG afresh (training draws nothing from it). On
CUDA the distributed optimizer's state is laid out by data-parallel size: the same ranks only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from timeshare.durable import fsync_directory, write_atomically
from timeshare.engines import step_dirs
from timeshare.errors import CheckpointError
from timeshare.task.files import GENERATION_CONFIG, TOKENIZER_FILES

if TYPE_CHECKING:  # (parallel.py imports megatron-core; an export needs none of it)
    from timeshare.engines.megatron.parallel import Layout

log = structlog.get_logger(__name__)

SUBDIR = "megatron"
LAYOUT_FILE = "layout.json"
# What a step keeps of the model directory beside its weights, so that an export of it is a
# whole model directory again: its config and its tokenizer (a job reads both from there)
MODEL_FILES = ("config.json", GENERATION_CONFIG, *TOKENIZER_FILES)


def step_dir(root: Path, step: int) -> Path:
    return step_dirs.step_dir(root, SUBDIR, step)


def shard_file(directory: Path, tp_rank: int) -> Path:
    return directory / f"tp{tp_rank}.pt"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pt"


def layout_of(directory: Path) -> tuple[int, int] | None:
    """(ranks, tensor-parallel size) that wrote the step (None: not known, not whole)."""
    try:
        written = json.loads((directory / LAYOUT_FILE).read_text())
        ranks, tp = written["ranks"], written["tensor_parallel_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    valid = all(isinstance(v, int) and v > 0 for v in (ranks, tp)) and ranks % tp == 0
    return (ranks, tp) if valid else None


def is_committed(directory: Path) -> bool:
    layout = layout_of(directory)
    if layout is None:
        return False
    ranks, tp = layout
    return all(shard_file(directory, t).is_file() for t in range(tp)) and all(
        rank_file(directory, r).is_file() for r in range(ranks)
    )


def committed_step(root: Path) -> int | None:
    """The newest step every rank that wrote it holds durably (None: none yet)."""
    return step_dirs.committed_step(root, SUBDIR, is_committed)


def save(
    root: Path,
    step: int,
    layout: Layout,
    own: dict[str, Any],
    shards: dict[str, Any] | None,
    *,
    model_dir: Path,
    keep: int = step_dirs.KEEP,
) -> Path:
    """Write `step` with every rank (a collective); return once this rank's part is durable.
    `shards`: this TP rank's parameters and optimiser state (None on the replicas that do not
    write them)."""
    directory = step_dir(root, step)
    try:
        if layout.rank == 0:
            _start_step(directory, layout, model_dir)
        if layout.world > 1:
            dist.barrier()  # nobody writes into the directory before it is clean
        if shards is not None:
            step_dirs.write_durably(shard_file(directory, layout.tp_rank), shards)
        step_dirs.write_durably(rank_file(directory, layout.rank), own)
        if layout.rank == 0:
            fsync_directory(directory)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {directory}: {exc}") from exc
    if layout.world > 1:
        dist.barrier()  # every part durable before rank 0 prunes an older step
    if layout.rank == 0:
        step_dirs.prune(root, SUBDIR, is_committed, keep)
    return directory


def _start_step(directory: Path, layout: Layout, model_dir: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    fsync_directory(directory.parent)
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, directory / name)
    written = {"ranks": layout.world, "tensor_parallel_size": layout.tp}
    write_atomically(directory / LAYOUT_FILE, json.dumps(written).encode())


def load(
    root: Path, step: int, layout: Layout, *, same_ranks: bool = False
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(this TP rank's shards, this rank's own state or None) of a committed step, in host
    memory. `same_ranks`: the step must have been written by this many ranks (megatron's
    distributed optimizer lays its state out by data-parallel size). Every rank reads the same
    files and decides alike: a step one rank refuses, every rank refuses."""
    directory = step_dir(root, step)
    written = layout_of(directory)
    assert written is not None, "a committed step has its layout"
    ranks, tp = written
    if tp != layout.tp:
        raise CheckpointError(
            f"{directory} was written with tensor_parallel_size {tp}; this job has {layout.tp} "
            "(resharding tensor parallelism is not supported: start from an export)"
        )
    if ranks != layout.world and same_ranks:
        raise CheckpointError(
            f"{directory} was written by {ranks} ranks; this job has {layout.world} (on CUDA the "
            "distributed optimizer's state is laid out by data-parallel size: start from an "
            "export)"
        )
    if ranks != layout.world:
        log.warning(
            "trainer.checkpoint.resharded",
            written_ranks=ranks,
            ranks=layout.world,
            note="data-parallel replicas read their TP rank's shards",
        )
    try:
        # on the host whatever device wrote them (the trainer copies them where they go)
        shards: dict[str, Any] = torch.load(
            shard_file(directory, layout.tp_rank), weights_only=True, map_location="cpu"
        )
        own_path = rank_file(directory, layout.rank)
        own = (
            torch.load(own_path, weights_only=True, map_location="cpu")
            if own_path.is_file()
            else None
        )
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {directory}: {exc}") from exc
    return shards, own
