"""What `timeshared` keeps in its state directory, so that a crash loses nothing it reported.

    progress.json   committed step, weight version, the last step's timings: rewritten
                    atomically (temporary file, fsync, rename, fsync of the directory)
    journal.jsonl   one JSON line per transition and per operator command, appended; a line
                    is written with one write(2) on an O_APPEND descriptor, so a crash leaves
                    whole lines (at most the last one missing)

The checkpoint the trainers write stays the truth of where training is; these files are what
the daemon said about it, for operators and for the tests that check a restart.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec

PROGRESS_FILE = "progress.json"
JOURNAL_FILE = "journal.jsonl"


def write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    temporary.replace(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_progress(state_dir: Path) -> dict[str, Any]:
    """The last progress written ({} when none, or when the file is unreadable)."""
    try:
        progress = msgspec.json.decode((state_dir / PROGRESS_FILE).read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}
    return progress if isinstance(progress, dict) else {}


def write_progress(state_dir: Path, progress: dict[str, Any]) -> None:
    write_atomically(state_dir / PROGRESS_FILE, msgspec.json.encode(progress))


class Journal:
    """The append-only record of every transition. Blocking: call it from a worker thread."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / JOURNAL_FILE
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def append(self, entries: list[dict[str, Any]]) -> None:
        lines = b"".join(msgspec.json.encode(e) + b"\n" for e in entries)
        os.write(self._fd, lines)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def journal_entry(kind: str, **fields: Any) -> dict[str, Any]:
    return {"time": time.time(), "kind": kind, **fields}


def read_journal(state_dir: Path) -> list[dict[str, Any]]:
    """Every whole line of the journal (a torn last line from a crash is skipped)."""
    entries = []
    try:
        text = (state_dir / JOURNAL_FILE).read_bytes()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            entries.append(msgspec.json.decode(line))
        except msgspec.DecodeError:
            continue
    return entries
