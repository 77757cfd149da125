"""The run's timeline as a Chrome trace (JSON array of trace events): Perfetto and
chrome://tracing open it.

One process per node, one thread (track) per rank and role, and the driver's own track:

    node 0 / driver          instant events: fences opening, commands, the lifecycle
    node 0 / rank 0 trainer  TRAIN OFFLOAD SYNC BARRIER RESUME ROLLOUT, one slice each, with
    node 0 / rank 0 rollout  step, version and the results' figures as args; inside each slice
                             the worker's own spans (the whole command, then what it did:
                             pack N / ACK N / finalize, load N, wake, generate, sleep, ...), and
                             at BARRIER the wait for every rank

`TraceBuilder` turns records (cycle/records.py) into events; `TraceFile` writes them as the run
goes (`[log].trace`), in a thread of its own; `timeshare trace RUN_DIR` feeds the records of the
run's log through the same builder. Times are microseconds from `origin_ns` (the wall clock, in
ns): the driver's anchor for a live trace, the earliest anchor of the log's records otherwise, so
that both give the same file for one run. A file cut off by a crash lacks only its closing `]`,
which both viewers accept; the process resuming the run keeps it as trace.prev.json.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NotRequired, TypedDict

import structlog

from timeshare.cycle.records import MarkRecord, PhaseRecord, Record
from timeshare.errors import ReportError
from timeshare.protocols.commands.results import ROLES
from timeshare.rotating import rotate_generations
from timeshare.state import Phase
from timeshare.timing import Clock, Span

log = structlog.get_logger(__name__)

DRIVER_TID = 0
BARRIER_WAIT = "wait for every rank"
CLOSE_S = 10.0  # for the writer's thread to write what is queued


class TraceEvent(TypedDict):
    """One event of Chrome's trace event format: a slice ("X"), an instant ("i") or a track's
    metadata ("M"); times in microseconds."""

    name: str
    ph: str
    pid: int
    tid: int
    cat: NotRequired[str]
    s: NotRequired[str]  # an instant's scope
    ts: NotRequired[float]
    dur: NotRequired[float]
    args: NotRequired[Mapping[str, object]]


def track_of(rank: int, role: str) -> int:
    """The thread id of a rank's role: the driver is 0, then trainer and rollout by rank."""
    return 1 + 2 * rank + ROLES.index(role)


class TraceBuilder:
    """Events of each record in turn (a track's name the first time it is used)."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self._named: set[tuple[int, int]] = set()

    def events(self, record: Record) -> list[TraceEvent]:
        if isinstance(record, MarkRecord):
            return self._mark(record)
        return self._phase(record)

    def _phase(self, record: PhaseRecord) -> list[TraceEvent]:
        events: list[TraceEvent] = []
        args = {"step": record.step, "version": record.version, **record.figures}
        end = record.start + record.seconds
        for role in ROLES:
            tid = track_of(record.rank, role)
            events += self._name(record.node, tid, f"rank {record.rank} {role}")
            phase = self._slice(
                record,
                tid,
                record.phase.upper(),
                category="phase",
                start=record.start,
                end=end,
                args=args,
            )
            events.append(phase)
            spans: tuple[Span, ...] = getattr(record, role)
            for span in sorted(spans, key=lambda s: (s.start, -s.seconds)):
                end_of_span = span.start + span.seconds
                events.append(
                    self._slice(
                        record, tid, span.name, category="worker", start=span.start, end=end_of_span
                    )
                )
            if record.phase == Phase.BARRIER.value and end > record.answered:
                wait = self._slice(
                    record, tid, BARRIER_WAIT, category="fence", start=record.answered, end=end
                )
                events.append(wait)
        return events

    def _mark(self, record: MarkRecord) -> list[TraceEvent]:
        return [
            *self._name(record.node, DRIVER_TID, "driver"),
            {
                "name": record.name,
                "cat": "driver",
                "ph": "i",
                "s": "t",
                "ts": self._us(record.clock, record.at),
                "pid": record.node,
                "tid": DRIVER_TID,
                "args": dict(record.args),
            },
        ]

    def _slice(
        self,
        record: PhaseRecord,
        tid: int,
        name: str,
        *,
        category: str,
        start: float,
        end: float,
        args: Mapping[str, object] | None = None,
    ) -> TraceEvent:
        begin_ns = record.clock.wall_ns_of(start)
        event: TraceEvent = {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": (begin_ns - self.origin_ns) / 1000,
            "dur": (record.clock.wall_ns_of(end) - begin_ns) / 1000,
            "pid": record.node,
            "tid": tid,
        }
        if args is not None:
            event["args"] = args
        return event

    def start_file(self) -> None:
        """The next events open a new file: each track is named again there."""
        self._named.clear()

    def _name(self, node: int, tid: int, name: str) -> list[TraceEvent]:
        """The metadata naming a track (and its node), once each."""
        events: list[TraceEvent] = []
        if (node, -1) not in self._named:
            self._named.add((node, -1))
            events += [
                _metadata("process_name", node, 0, name=f"node {node}"),
                _metadata("process_sort_index", node, 0, sort_index=node),
            ]
        if (node, tid) not in self._named:
            self._named.add((node, tid))
            events += [
                _metadata("thread_name", node, tid, name=name),
                _metadata("thread_sort_index", node, tid, sort_index=tid),
            ]
        return events

    def _us(self, clock: Clock, monotonic: float) -> float:
        return (clock.wall_ns_of(monotonic) - self.origin_ns) / 1000


def _metadata(kind: str, pid: int, tid: int, **args: object) -> TraceEvent:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def origin_of(records: Iterable[Record]) -> int:
    """The origin of a trace of `records`: the earliest anchor among them."""
    return min(record.clock.wall_ns for record in records)


def write_trace(records: list[Record], path: Path) -> int:
    """The whole trace of `records` into `path` (as `TraceFile` would have); how many events."""
    if not records:
        raise ReportError("no phase of the run is in its log: nothing to trace")
    builder = TraceBuilder(origin_of(records))
    count = 0
    with _TraceText(path) as text:
        for record in records:
            events = builder.events(record)
            text.write(events)
            count += len(events)
    return count


class _TraceText:
    """The JSON array, an event per line: `[`, the events, `]` (omitted by a crash)."""

    def __init__(self, path: Path, *, keep_previous: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if keep_previous and path.exists():
            path.replace(previous_of(path))
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._file.write("[")
        self._first = True

    @property
    def size(self) -> int:
        return self._file.tell()

    def write(self, events: list[TraceEvent]) -> None:
        for event in events:
            self._file.write(("\n" if self._first else ",\n") + json.dumps(event, allow_nan=False))
            self._first = False
        self._file.flush()

    def close(self) -> None:
        self._file.write("\n]\n")
        self._file.close()

    def __enter__(self) -> _TraceText:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def previous_of(path: Path) -> Path:
    """Where a live trace keeps the one an earlier process left at its path: trace.prev.json."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


class TraceFile:
    """`[log].trace`: the records of this process's runs as they come, written by a thread so
    that `add` never waits for the disk (the cycle calls it from its event loop). A trace an
    earlier process left at the path (a run killed, then resumed) is kept as `previous_of`.

    At `max_bytes` (0: never) the file is closed, a whole JSON array, and kept as `<path>.1`
    (older ones as .2, ..., `keep` of them, as the log's: rotating.py); the next starts anew,
    its tracks named again, so that each file opens on its own in Perfetto."""

    def __init__(self, path: Path, origin_ns: int, max_bytes: int = 0, keep: int = 0) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._builder = TraceBuilder(origin_ns)
        self._text = _TraceText(path, keep_previous=True)  # OSError: the caller's to report
        self._queue: queue.SimpleQueue[Record | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="trace-file", daemon=True)
        self._thread.start()

    def add(self, record: Record) -> None:
        if self._thread.is_alive():  # (gone after a write failed: logged, the run goes on)
            self._queue.put(record)

    def close(self) -> None:
        """Everything queued written and the file closed (blocks: call it off the event loop)."""
        self._queue.put(None)
        self._thread.join(CLOSE_S)

    def _start_next_file(self) -> None:
        self._text.close()
        rotate_generations(self.path, self.keep)
        self._text = _TraceText(self.path)
        self._builder.start_file()

    def _write(self) -> None:
        try:
            while (record := self._queue.get()) is not None:
                self._text.write(self._builder.events(record))
                if self.max_bytes and self._text.size >= self.max_bytes:
                    self._start_next_file()
        except Exception as exc:  # a full disk must not end the run: its log keeps the records
            log.warning("trace.write.failed", path=str(self.path), error=repr(exc))
        finally:
            try:
                self._text.close()
            except OSError as exc:
                log.warning("trace.write.failed", path=str(self.path), error=str(exc))
