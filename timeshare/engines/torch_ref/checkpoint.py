"""Durable, atomic checkpoints per rank, and the step the whole job has committed.

Each rank writes `<job dir>/rank<r>/step-<k>/state.pt`: into a temporary directory first, the
file and the directory fsynced, then renamed into place and the parent fsynced. A step is
committed when every rank holds it durably; a run resumes from the newest committed step. The
newest `keep` committed steps of the job are kept: a rank keeps one more of its own, as it may be
a step ahead of the job's committed step, which must survive.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from timeshare.durable import fsync_directory
from timeshare.errors import CheckpointError

KEEP = 3
STATE_FILE = "state.pt"
STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(rank_dir: Path, step: int) -> Path:
    return rank_dir / f"step-{step:08d}"


def write(rank_dir: Path, step: int, state: dict[str, Any], *, keep: int = KEEP) -> Path:
    """Write `state` as `step` of this rank; return once it is durable."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    final = step_dir(rank_dir, step)
    temporary = rank_dir / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        with open(temporary / STATE_FILE, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        fsync_directory(temporary)
        if final.exists():  # a step redone after a crash: the new one replaces it whole
            shutil.rmtree(final)
        temporary.rename(final)
        fsync_directory(rank_dir)
    except OSError as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from exc
    _prune(rank_dir, keep + 1)
    return final


def durable_steps(rank_dir: Path) -> set[int]:
    if not rank_dir.is_dir():
        return set()
    return {
        int(match.group(1))
        for entry in rank_dir.iterdir()
        if (match := STEP_DIR.match(entry.name)) and (entry / STATE_FILE).exists()
    }


def committed_step(job_dir: Path, ranks: int) -> int | None:
    """The newest step every rank of the job holds durably (None: none yet)."""
    common = set.intersection(*(durable_steps(job_dir / f"rank{r}") for r in range(ranks)))
    return max(common) if common else None


def read(rank_dir: Path, step: int) -> dict[str, Any]:
    path = step_dir(rank_dir, step) / STATE_FILE
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    return state


def _prune(rank_dir: Path, kept: int) -> None:
    for step in sorted(durable_steps(rank_dir))[:-kept]:
        shutil.rmtree(step_dir(rank_dir, step), ignore_errors=True)
    for entry in rank_dir.iterdir():  # temporaries of writers that died
        if entry.name.startswith(".step-") and not _owner_alive(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


def _owner_alive(name: str) -> bool:
    pid = int(name.rsplit("-", 1)[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
