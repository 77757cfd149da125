"""The run's timeline as the cycle tells it: one record per phase of each rank, one per mark.

A `PhaseRecord` is a phase report with everything a timeline shows: when the phase ran on the
driver's clock, when both workers had answered (at BARRIER the rest is the wait for every rank),
the figures its results carry, and the spans each worker recorded (timing.py). A `MarkRecord` is
a moment of the driver's: a fence opening, an operator's command arriving, the run's lifecycle
changing. The cycle logs every record (`cycle.phase.ended`, `cycle.moment.marked`, at info:
telling.py) and hands it to the front end's `on_record` hook: a trace written as the run goes
(`[log].trace`) and one rebuilt from the log afterwards (`timeshare trace RUN_DIR`) read the
same records.

Times are the node's `time.monotonic()`; each record carries the driver's `Clock`, which places
them on the wall clock (traces of several nodes line up by it).
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog

from timeshare.timing import Clock, Span

log = structlog.get_logger(__name__)

PHASE_EVENT = "cycle.phase.ended"
MARK_EVENT = "cycle.moment.marked"

Figure = float | int | str | bool | None


class PhaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's phase on the timeline, as logged and traced: the driver's `PhaseReport`
    (hooks.py) flattened to plain figures and spans, on a clock a reader can place."""

    node: int
    rank: int  # global
    phase: str
    step: int
    version: int  # the weight version the phase makes (TRAIN), moves (SYNC) or serves
    start: float
    seconds: float  # as the summary has it
    answered: float  # both workers had answered
    clock: Clock
    figures: dict[str, Figure]  # "role.field": what the results say (gbps, reward_mean, ...)
    trainer: tuple[Span, ...]
    rollout: tuple[Span, ...]


class MarkRecord(msgspec.Struct, frozen=True, kw_only=True):
    node: int
    name: str  # "fence SYNC", "command pause", "paused", ...
    at: float
    clock: Clock
    args: dict[str, Figure] = {}


Record = PhaseRecord | MarkRecord


def log_record(record: Record) -> None:
    """The record as one line of the run's log (where `timeshare trace` finds it)."""
    event = PHASE_EVENT if isinstance(record, PhaseRecord) else MARK_EVENT
    log.info(event, record=msgspec.to_builtins(record))


def record_of_line(line: dict[str, Any]) -> Record | None:
    """The record a log line holds (None: a line of something else). Raises
    `msgspec.ValidationError` for a record line that does not hold one."""
    event = line.get("event")
    if event == PHASE_EVENT:
        return msgspec.convert(line.get("record"), PhaseRecord)
    if event == MARK_EVENT:
        return msgspec.convert(line.get("record"), MarkRecord)
    return None
