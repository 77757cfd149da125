"""The `--summary` file of `timeshare run`: every step's figures (cycle/steps.py defines them).

JSON lines: a first line saying what the run is (`{"config": ..., "ranks": ...}`), then one line
per step, appended and fsynced as the step ends, so that writing a step costs the same at step
10 as at step 1,000,000 and the writer holds no step in memory. A run resumed from committed
step k rewrites the file once, keeping the steps up to k, and appends from k+1: no committed
step appears twice and weight versions only grow. A last line cut short by a crash is skipped.

`read_summary` also reads the older format, one JSON object `{"config", "ranks", "steps": [...]}`
rewritten whole after every step (a resumed run converts it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from timeshare.cycle.steps import StepFigures
from timeshare.durable import write_atomically


class SummaryData(NamedTuple):
    config: str  # "" where the file does not say
    ranks: int
    steps: list[dict[str, Any]]


def read_summary(path: Path) -> SummaryData:
    """What a summary file holds, in either format. OSError, ValueError (not JSON), KeyError or
    TypeError (not a summary) for the caller to name."""
    with path.open(encoding="utf-8") as file:
        first = file.readline()
        head = _json_object(first)
        if head is None or "steps" in head:  # the older format: one object, indented
            data = json.loads(first + file.read())
            return SummaryData(str(data.get("config") or ""), int(data["ranks"]), data["steps"])
        steps = [step for line in file if (step := _json_object(line)) is not None]
    return SummaryData(str(head.get("config") or ""), int(head["ranks"]), steps)


def _json_object(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None  # a line cut short, or the first of an indented object
    return value if isinstance(value, dict) else None


class SummaryFile:
    """The file a run appends its steps to."""

    def __init__(self, path: Path, ranks: int, config: str = "") -> None:
        self.path = path
        self.ranks = ranks
        self.config = config  # the config's name (its file's stem): the report's title
        self.last_step = -1  # the newest step the file holds (-1: none)

    def resume_from(self, committed: int) -> None:
        """Keep what the file says up to `committed` (rewritten whole, once), then append."""
        kept: list[dict[str, Any]] = []
        if self.path.exists():
            kept = [s for s in read_summary(self.path).steps if s["step"] <= committed]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = {"config": self.config, "ranks": self.ranks}
        lines = (json.dumps(line).encode() + b"\n" for line in [header, *kept])
        write_atomically(self.path, lines)  # streamed: a long run's summary is never held whole
        self.last_step = max((s["step"] for s in kept), default=-1)

    def has(self, step: int) -> bool:
        """Whether the file holds `step` (it holds every step up to the newest)."""
        return 0 <= step <= self.last_step

    def append(self, figures: StepFigures) -> None:
        line = msgspec.json.encode(figures) + b"\n"
        with self.path.open("ab") as file:
            file.write(line)
            file.flush()
            os.fsync(file.fileno())
        self.last_step = figures.step
