"""What `timeshared` keeps in its state directory, so that a crash loses nothing it reported.

    progress.json   committed step, weight version, the last step's timings: rewritten
                    atomically (temporary file, fsync, rename, fsync of the directory)
    journal.jsonl   one JSON line per transition and per operator command, appended (and
                    rotated once past 64 MiB into journal.jsonl.1); a line
                    is written with one write(2) on an O_APPEND descriptor, so a crash leaves
                    whole lines (at most the last one missing)

The checkpoint the trainers write stays the truth of where training is; these files are what
the daemon said about it, for operators and for the tests that check a restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import msgspec

from timeshare.durable import write_atomically

PROGRESS_FILE = "progress.json"
JOURNAL_FILE = "journal.jsonl"
JOURNAL_MAX_BYTES = 64 << 20


def read_progress(state_dir: Path) -> dict[str, Any]:  # (JSON as written, for a reader)
    """The last progress written ({} when none, or when the file is unreadable)."""
    try:
        progress = msgspec.json.decode((state_dir / PROGRESS_FILE).read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}
    return progress if isinstance(progress, dict) else {}


def write_progress(state_dir: Path, progress: dict[str, object]) -> None:
    write_atomically(state_dir / PROGRESS_FILE, msgspec.json.encode(progress))


class Journal:
    """The append-only record of every transition. Blocking: call it from a worker thread.

    A service runs for days: past `max_bytes` the file becomes `journal.jsonl.1` (replacing the
    one before) and a new one starts, so the journal keeps between one and two files' worth.
    """

    def __init__(self, state_dir: Path, max_bytes: int = JOURNAL_MAX_BYTES) -> None:
        self.path = state_dir / JOURNAL_FILE
        self.max_bytes = max_bytes
        self._fd = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def append(self, entries: list[dict[str, object]]) -> None:
        lines = b"".join(msgspec.json.encode(e) + b"\n" for e in entries)
        if os.fstat(self._fd).st_size + len(lines) > self.max_bytes:
            self._rotate()
        os.write(self._fd, lines)

    def _rotate(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)
        self.path.replace(self.path.with_name(f"{JOURNAL_FILE}.1"))
        self._fd = self._open()

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def journal_entry(kind: str, **fields: object) -> dict[str, object]:
    return {"time": time.time(), "kind": kind, **fields}


def read_journal(state_dir: Path) -> list[dict[str, Any]]:  # (JSON as written, for a reader)
    """Every whole line of the journal, oldest first (a line torn by a crash is skipped)."""
    entries = []
    text = b""
    for name in (f"{JOURNAL_FILE}.1", JOURNAL_FILE):  # the rotated part first
        with suppress(FileNotFoundError):
            text += (state_dir / name).read_bytes()
    for line in text.splitlines():
        try:
            entries.append(msgspec.json.decode(line))
        except msgspec.DecodeError:
            continue
    return entries


class RecordWriter:
    """Journal lines and progress.json, written off the event loop as they come.

    `add` and `progress_changed` only queue (they are called between phases); `run` writes
    in a worker thread; `flush` writes what is queued now, and is shielded: a batch taken off
    the queue is written even while the daemon exits.
    """

    def __init__(self, state_dir: Path, progress: Callable[[], dict[str, object]]) -> None:
        self.state_dir = state_dir
        self.journal = Journal(state_dir)
        self.progress = progress
        self._pending: list[dict[str, object]] = []
        self._progress_dirty = False
        self._wake = anyio.Event()
        self._writing = anyio.Lock()

    def add(self, *entries: dict[str, object]) -> None:
        self._pending.extend(entries)
        self._wake.set()

    def progress_changed(self) -> None:
        self._progress_dirty = True
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            await self.flush()

    async def flush(self) -> None:
        with anyio.CancelScope(shield=True):
            async with self._writing:  # the writer task and an explicit flush: one at a time
                pending, self._pending = self._pending, []
                if pending:
                    await anyio.to_thread.run_sync(self.journal.append, pending)
                if self._progress_dirty:
                    self._progress_dirty = False
                    progress = {**self.progress(), "written": time.time()}
                    await anyio.to_thread.run_sync(write_progress, self.state_dir, progress)

    async def close(self) -> None:
        self._progress_dirty = True
        await self.flush()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.journal.sync)
        self.journal.close()
