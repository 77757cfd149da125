"""Spans: what a process did and when, as slices of the run's timeline (`[log].trace`).

Every clock reading is `time.monotonic()`: on Linux one clock for every process of the machine,
so a worker's spans and its driver's phases share one timeline without conversion. A `Clock`
anchors that timeline to the wall clock once per driver process (for traces of several nodes).

    spans = Spans()
    with spans.span("pack 3"):
        ...
    result = msgspec.structs.replace(result, spans=spans.take())

Spans a command records nest by time: one taken inside another lies within it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import msgspec

# Spans one command keeps (a weight transfer of thousands of buckets records two per bucket):
# later ones are not kept, so that a result, a log line and a trace stay small.
MAX_SPANS = 1024


class Span(NamedTuple):
    """`name` ran from `start` (time.monotonic()) for `seconds`. A tuple on the wire."""

    name: str
    start: float
    seconds: float


class Clock(msgspec.Struct, frozen=True, array_like=True):
    """A monotonic reading and the wall clock's at the same moment, in integer nanoseconds:
    converts one process's monotonic times to times of the wall clock without rounding."""

    monotonic: float
    wall_ns: int

    @classmethod
    def now(cls) -> Clock:
        return cls(time.monotonic(), time.time_ns())

    def wall_ns_of(self, monotonic: float) -> int:
        return self.wall_ns + round((monotonic - self.monotonic) * 1e9)


@functools.cache
def process_clock() -> Clock:
    """This process's anchor, taken once: every record of it converts the same way."""
    return Clock.now()


class Spans:
    """The spans of one command, in the order they ended (the first `limit` of them)."""

    def __init__(self, limit: int = MAX_SPANS) -> None:
        self.limit = limit
        self._spans: list[Span] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block as a span called `name` (also when it raises)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.add(Span(name, start, time.monotonic() - start))

    def add(self, span: Span) -> None:
        if len(self._spans) < self.limit:
            self._spans.append(span)

    def extend(self, spans: Iterable[Span]) -> None:
        for span in spans:
            self.add(span)

    def take(self) -> tuple[Span, ...]:
        """The spans recorded so far, forgotten here (the next command starts afresh)."""
        taken, self._spans = tuple(self._spans), []
        return taken
