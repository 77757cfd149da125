"""The step directories of a sharded trainer's checkpoints (FSDP's, Megatron's):
`<job checkpoint dir>/<trainer>/step-<k>/`, one per step, written by all ranks together.

What a step directory must hold to be committed is each trainer's own rule (`Committed`); the
rest is common: listing the steps, the newest committed one, the step every rank agrees on,
pruning, and writing a rank's part durably.
"""

from __future__ import annotations

import io
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from timeshare.durable import write_atomically
from timeshare.errors import CheckpointError

KEEP = 3  # newest committed steps kept
STEP_DIR = re.compile(r"^step-(\d+)$")
Committed = Callable[[Path], bool]  # a step directory -> whether every rank's part is durable


def step_dir(root: Path, trainer: str, step: int) -> Path:
    return root / trainer / f"step-{step:08d}"


def steps(root: Path, trainer: str) -> list[int]:
    """Every step with a directory (committed or not), oldest first."""
    parent = root / trainer
    if not parent.is_dir():
        return []
    return sorted(int(m.group(1)) for e in parent.iterdir() if (m := STEP_DIR.match(e.name)))


def committed_step(root: Path, trainer: str, is_committed: Committed) -> int | None:
    """The newest step every rank that wrote it holds durably (None: none yet)."""
    done = [s for s in steps(root, trainer) if is_committed(step_dir(root, trainer, s))]
    return max(done) if done else None


def agreed(step: int | None, world: int, device: torch.device, root: Path) -> int | None:
    """The committed step, the same on every rank (a collective): each rank reads the
    checkpoint directory itself, and ranks that see it differently (a directory not shared, a
    stale cache) must not resume from different steps."""
    if world == 1:
        return step
    seen = torch.tensor([-1 if step is None else step] * 2, device=device)
    seen[1] = -seen[1]  # one all-reduce gives the smallest and the largest
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    smallest, largest = int(seen[0]), -int(seen[1])
    if smallest != largest:
        raise CheckpointError(
            f"the trainer ranks see different committed steps in {root} (from {smallest} to "
            f"{largest}; -1: none): the checkpoint directory must be one directory that every "
            "rank sees"
        )
    return None if step is None else smallest


def prune(root: Path, trainer: str, is_committed: Committed, keep: int = KEEP) -> None:
    """Keep the newest `keep` committed steps, and nothing older that never committed."""
    committed = [s for s in steps(root, trainer) if is_committed(step_dir(root, trainer, s))]
    if len(committed) <= keep:
        return
    oldest_kept = committed[-keep]
    for step in steps(root, trainer):
        if step < oldest_kept:
            shutil.rmtree(step_dir(root, trainer, step), ignore_errors=True)


def write_durably(path: Path, value: Mapping[str, object]) -> None:
    """`value` saved by torch to `path`, atomically and durably (its presence: it is whole)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    write_atomically(path, buffer.getvalue())
