"""A run's directory: where `timeshare run --summary DIR/summary.json` wrote its step figures
(and where `make demo` keeps them: runs/tiny-grpo/). Missing or empty is `RunDirError`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from timeshare.cycle.steps import StepFigures
from timeshare.errors import RunDirError

SUMMARY = "summary.json"


@dataclass(frozen=True)
class RunDir:
    path: Path
    ranks: int
    steps: list[StepFigures]

    @classmethod
    def open(cls, path: Path) -> RunDir:
        """Read the run in `path` (a directory, or its summary file itself)."""
        summary = path if path.is_file() else path / SUMMARY
        if not path.exists():
            raise RunDirError(f"{path}: no such run directory")
        if not summary.is_file():
            raise RunDirError(
                f"{path}: holds no {SUMMARY} (a run writes it with `timeshare run CONFIG "
                f"--summary {path / SUMMARY}`)"
            )
        try:
            data = json.loads(summary.read_text())
            steps = msgspec.convert(data["steps"], list[StepFigures])
            ranks = int(data["ranks"])
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
            raise RunDirError(f"{summary}: not a run's summary: {exc}") from exc
        if not steps:
            raise RunDirError(f"{summary}: the run finished no step yet")
        return cls(summary.parent, ranks, steps)
