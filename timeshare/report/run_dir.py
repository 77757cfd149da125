"""A run's directory: where `timeshare run --summary DIR/summary.json` wrote its step figures and
where the run keeps its log (`[log].file = "DIR/log.jsonl"`, as `make demo` does in
runs/tiny-grpo/). Each part is read when asked for; one missing or empty is `ReportError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from timeshare.cycle.records import PhaseRecord, Record, record_of_line
from timeshare.cycle.steps import StepFigures
from timeshare.errors import ReportError
from timeshare.report.summary import read_summary
from timeshare.rotating import rotated_paths

SUMMARY = "summary.json"
LOG = "log.jsonl"


@dataclass(frozen=True)
class Summary:
    config: str  # the config's name (the directory's, for a summary that does not say)
    ranks: int
    steps: list[StepFigures]


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def at(cls, path: Path) -> RunDir:
        """The run in `path` (a directory, or its summary file itself)."""
        if not path.exists():
            raise ReportError(f"{path}: no such run directory")
        return cls(path.parent if path.is_file() else path)

    @property
    def name(self) -> str:
        return self.path.name

    def summary(self) -> Summary:
        """Every step the summary holds (at least one)."""
        summary = self.path / SUMMARY
        if not summary.is_file():
            raise ReportError(
                f"{self.path}: holds no {SUMMARY} (a run writes it with `timeshare run CONFIG "
                f"--summary {summary}`)"
            )
        try:
            data = read_summary(summary)
            steps = msgspec.convert(data.steps, list[StepFigures])
            ranks = data.ranks
            config = data.config or self.name
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
            raise ReportError(f"{summary}: not a run's summary: {exc}") from exc
        if not steps:
            raise ReportError(f"{summary}: the run finished no step yet")
        return Summary(config, ranks, steps)

    def records(self) -> list[Record]:
        """The timeline's records in the log and its rotated generations, in the order they
        were logged (at least one phase). A line cut short by a crash, or not JSON, is
        skipped."""
        log = self.path / LOG
        if not log.is_file():
            raise ReportError(
                f"{self.path}: holds no {LOG} (a run keeps its log there with "
                f'`[log] file = "{log}"`)'
            )
        records: list[Record] = []
        for generation in rotated_paths(log):  # rotated ones first ([log] max_mb)
            try:
                with generation.open(encoding="utf-8", errors="replace") as lines:
                    for number, line in enumerate(lines, 1):
                        record = _record(line, generation, number)
                        if record is not None:
                            records.append(record)
            except OSError as exc:
                raise ReportError(f"{generation}: {exc}") from exc
        if not any(isinstance(record, PhaseRecord) for record in records):
            raise ReportError(
                f"{log}: no phase of the run is in it (the cycle logs each at level info: "
                "was [log].level warning or above, or did no phase end?)"
            )
        return records


def _record(line: str, log: Path, number: int) -> Record | None:
    try:
        fields = json.loads(line)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    try:
        return record_of_line(fields)
    except msgspec.ValidationError as exc:
        message = f"{log}:{number}: a record of the timeline that does not read: {exc}"
        raise ReportError(message) from exc
