"""Fixtures shared by every test: short runtime directories and a leak check around each test."""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from timeshare.protocols.weights.segments import SEGMENT_PREFIX, SHM_DIR

# Tests read logs from stderr only; stdout of peer processes carries their JSON events.
structlog.configure(logger_factory=structlog.PrintLoggerFactory(__import__("sys").stderr))


def staging_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}*")}


def socket_files(directory: Path) -> list[Path]:
    if not directory.exists():
        return []
    return [p for p in directory.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A private runtime directory with a short path (ipc paths are limited to 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    directory.chmod(0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaked_staging() -> Iterator[None]:
    """Every test must leave /dev/shm as it found it."""
    before = staging_segments()
    yield
    leaked = staging_segments() - before
    assert not leaked, f"staging segments left in /dev/shm: {sorted(leaked)}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need a CUDA device; without one they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
