"""Names of shared-memory staging segments: whose a segment is, and sweeping the orphaned ones.

Segments are named ``ts-w-<tag>-<pid>-<starttime>-<session>-<i>``. The tag ties a segment to
one runtime directory (`staging_tag`); pid and start time name the process that created it, so
that `sweep_stale_segments` can tell a segment whose owner is gone (pid dead, or reused by a
process that started at another time) from a live one. No torch here: the daemon sweeps, and
the test suite checks for leaks, without loading the staging itself (shm.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import NamedTuple

from timeshare.runtime import SHM_ROOT, process_start_time, running_since

SEGMENT_PREFIX = "ts-w-"
_SEGMENT_RE = re.compile(r"^ts-w-(?P<tag>[0-9a-z]+)-(?P<pid>\d+)-(?P<start>\d+)-[0-9a-f]+-\d+$")


class SegmentName(NamedTuple):
    """What a segment's name says: its runtime directory's tag and the process that made it."""

    tag: str
    pid: int
    start: int  # the owner's start time (process_start_time)


def staging_tag(runtime_dir: Path | None) -> str:
    """The part of a segment name that ties it to one runtime directory (or to TCP endpoints)."""
    if runtime_dir is None:
        return "tcp"
    return hashlib.sha256(str(runtime_dir.resolve()).encode()).hexdigest()[:10]


def segment_names(*, tag: str, session: int, count: int) -> list[str]:
    """Names for `count` new segments of `session`, owned by this process."""
    pid = os.getpid()
    start = process_start_time(pid) or 0
    return [f"{SEGMENT_PREFIX}{tag}-{pid}-{start}-{session:016x}-{i}" for i in range(count)]


def parse_segment_name(name: str) -> SegmentName | None:
    """The parts of a staging segment's name; None for any other name."""
    match = _SEGMENT_RE.match(name)
    if match is None:
        return None
    return SegmentName(match["tag"], int(match["pid"]), int(match["start"]))


def sweep_stale_segments(tag: str | None = None) -> list[str]:
    """Remove staging segments whose owner process is gone; return their names.

    With a `tag`, only that runtime directory's segments are considered.
    """
    removed: list[str] = []
    for path in SHM_ROOT.glob(f"{SEGMENT_PREFIX}*"):
        parsed = parse_segment_name(path.name)
        if parsed is None or (tag is not None and parsed.tag != tag):
            continue
        if running_since(parsed.pid) == parsed.start:
            continue  # owner alive
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed
