"""Writing files so that a crash leaves the old version or the new one, never a torn one."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def fsync_directory(path: Path) -> None:
    """Make the entries of directory `path` (a rename into it) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Replace `path` with `data` whole: a temporary file, fsync, rename, fsync of the directory.
    `data` may come in pieces (a long file need not be held in memory at once)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            file.writelines([data] if isinstance(data, bytes) else data)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(path.parent)
