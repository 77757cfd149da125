"""The `--summary` JSON of `timeshare run`: every step's figures (cycle/steps.py defines them).

Rewritten atomically after every step. A run resumed from committed step k keeps the steps up
to k it finds there and appends from k+1, so no committed step appears twice and weight
versions only grow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from timeshare.cycle.steps import StepFigures
from timeshare.durable import write_atomically


class SummaryFile:
    """The file, and the steps it holds."""

    def __init__(self, path: Path, ranks: int, config: str = "") -> None:
        self.path = path
        self.ranks = ranks
        self.config = config  # the config's name (its file's stem): the report's title
        self.steps: list[dict[str, Any]] = []

    def resume_from(self, committed: int) -> None:
        if self.path.exists():
            previous = json.loads(self.path.read_text())
            self.steps = [s for s in previous.get("steps", []) if s["step"] <= committed]
        self.write()

    def has(self, step: int) -> bool:
        return any(s["step"] == step for s in self.steps)

    def append(self, figures: StepFigures) -> None:
        self.steps.append(msgspec.to_builtins(figures))
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fields = {"config": self.config, "ranks": self.ranks, "steps": self.steps}
        text = json.dumps(fields, indent=1)
        write_atomically(self.path, text.encode())
