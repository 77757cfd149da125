"""A file that every process of a run appends lines to, rotated once it reaches a size.

`log.jsonl` is written by the front and by every worker, for as long as the job runs: days. At
`max_bytes` the writer that notices renames it to `log.jsonl.1` (and `.1` to `.2`, ..., the
oldest beyond `keep` removed), under an flock so that two writers never rotate at once, and
starts a new `log.jsonl`; every other writer sees the path's inode change at its next line and
reopens. Lines are written whole, one `write` each (O_APPEND): processes never tear each other's
lines, and a line is never split across two files. `rotated_paths` lists a file's generations,
oldest first, for the readers (`timeshare trace`, `timeshare report`).
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

MIB = 1 << 20


def rotated_paths(path: Path) -> list[Path]:
    """`path`'s rotated generations that exist, oldest first, then `path` itself (if it does)."""
    generations = []
    for candidate in path.parent.glob(f"{path.name}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            generations.append((int(suffix), candidate))
    older = [p for _, p in sorted(generations, reverse=True)]
    return [*older, path] if path.exists() else older


def rotate_generations(path: Path, keep: int) -> None:
    """`path` becomes `<path>.1`, `.1` becomes `.2`, ...; the one beyond `keep` is removed
    (`keep` 0: `path` itself is)."""
    path.with_name(f"{path.name}.{keep}").unlink(missing_ok=True)
    for generation in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{generation}")
        if older.exists():
            older.rename(path.with_name(f"{path.name}.{generation + 1}"))
    if keep:
        path.rename(path.with_name(f"{path.name}.1"))
    else:
        path.unlink(missing_ok=True)


class RotatingFile:
    """Append-only lines into `path`, rotated at `max_bytes` (0: never), keeping `keep` old
    generations. A text stream as far as structlog and logging need one (write, flush)."""

    def __init__(self, path: Path, max_bytes: int, keep: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()  # this process's threads (logging, structlog)
        self._fd = self._open()

    def write(self, text: str) -> int:
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            if self.max_bytes:
                self._follow_rotation()
            os.write(self._fd, data)
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered: every line is written as it comes."""

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _follow_rotation(self) -> None:
        """Reopen when another writer rotated the file; rotate it when it is full."""
        if not self._current():
            self._reopen()
        if os.fstat(self._fd).st_size < self.max_bytes:
            return
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file closes
            if self._current() and os.fstat(self._fd).st_size >= self.max_bytes:
                rotate_generations(self.path, self.keep)
            self._reopen()

    def _current(self) -> bool:
        """Whether this writer's descriptor is still the file at `path`."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._fd)
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)

    def _reopen(self) -> None:
        os.close(self._fd)
        self._fd = self._open()
