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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import msgspec

# Spans one command keeps (a weight transfer of thousands of buckets records two per bucket),
# so that a result, a log line (under the journal's 48 KiB) and a trace stay small: the first
# ones, and the last `TAIL_SPANS` (how the command ended: finalize, offload).
MAX_SPANS = 256
TAIL_SPANS = 16


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
    """The spans of one command, in the order they ended: all of them, or past `limit` the
    first `limit - tail` and the last `tail`."""

    def __init__(
        self,
        limit: int = MAX_SPANS,
        tail: int = TAIL_SPANS,
        *,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        assert 0 <= tail < limit, (limit, tail)
        self._on_end = on_end  # called as each span ends well: a worker's progress
        self._head: list[Span] = []
        self._head_limit = limit - tail
        self._tail: deque[Span] = deque(maxlen=tail)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block as a span called `name` (also when it raises)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.add(Span(name, start, time.monotonic() - start))
        if self._on_end is not None:
            self._on_end()

    def add(self, span: Span) -> None:
        if len(self._head) < self._head_limit:
            self._head.append(span)
        elif self._tail.maxlen:
            self._tail.append(span)

    def extend(self, spans: Iterable[Span]) -> None:
        for span in spans:
            self.add(span)

    def take(self) -> tuple[Span, ...]:
        """The spans recorded so far, forgotten here (the next command starts afresh)."""
        taken = (*self._head, *self._tail)
        self._head.clear()
        self._tail.clear()
        return taken
