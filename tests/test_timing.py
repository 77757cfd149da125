"""Spans and the clock that places them: what the trace is made of."""

from __future__ import annotations

import time

import pytest

from timeshare.timing import Clock, Span, Spans


def test_spans_time_their_blocks_and_are_taken_once() -> None:
    spans = Spans()
    before = time.monotonic()
    with spans.span("outer"):
        with spans.span("inner"):
            time.sleep(0.01)
    with pytest.raises(ValueError), spans.span("failed"):
        raise ValueError("still timed")
    taken = spans.take()
    assert [span.name for span in taken] == ["inner", "outer", "failed"]  # in the order they ended
    inner, outer, _ = taken
    assert before <= outer.start <= inner.start
    assert inner.start + inner.seconds <= outer.start + outer.seconds  # nested
    assert inner.seconds >= 0.01
    assert spans.take() == ()


def test_each_span_that_ends_well_is_progress_and_one_that_raises_is_not() -> None:
    ended: list[int] = []
    spans = Spans(on_end=lambda: ended.append(len(ended)))
    with spans.span("wake weights"):
        assert ended == []
    with pytest.raises(ValueError), spans.span("failed"):
        raise ValueError("no progress")
    with spans.span("digest"):
        pass
    assert ended == [0, 1]


def test_past_the_limit_the_first_spans_and_the_last_are_kept() -> None:
    spans = Spans(limit=5, tail=2)
    spans.extend(Span(f"pack {i}", float(i), 0.5) for i in range(10))
    spans.add(Span("finalize", 10.0, 0.1))
    names = [span.name for span in spans.take()]
    assert names == ["pack 0", "pack 1", "pack 2", "pack 9", "finalize"]
    spans.add(Span("next", 11.0, 0.1))
    assert [span.name for span in spans.take()] == ["next"]


def test_the_clock_converts_monotonic_times_to_wall_nanoseconds_exactly() -> None:
    clock = Clock(monotonic=1000.0, wall_ns=1_764_547_200_000_000_000)
    assert clock.wall_ns_of(1000.0) == clock.wall_ns
    assert clock.wall_ns_of(1001.5) - clock.wall_ns == 1_500_000_000
    assert clock.wall_ns_of(999.999999999) - clock.wall_ns == -1
    now = Clock.now()
    assert abs(now.wall_ns_of(time.monotonic()) - time.time_ns()) < 50_000_000
