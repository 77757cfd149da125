"""The trace builder and file on records made here: tracks, nesting, the clock, the format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from tests.report.trace_format import check_events, check_timeline, load_trace, ns
from timeshare.cycle.hooks import PhaseReport
from timeshare.cycle.records import MarkRecord, PhaseRecord, Record, record_of_line
from timeshare.cycle.telling import phase_record
from timeshare.errors import ReportError
from timeshare.protocols.commands.results import (
    CommandResult,
    SyncResult,
    TrainFigures,
    TrainResult,
    WorkerLoad,
)
from timeshare.protocols.weights import TransferReport
from timeshare.report.trace import (
    BARRIER_WAIT,
    DRIVER_TID,
    TraceBuilder,
    TraceFile,
    previous_of,
    track_of,
    write_trace,
)
from timeshare.rotating import rotated_paths
from timeshare.state import Phase
from timeshare.timing import Clock, Span

CLOCK = Clock(monotonic=100.0, wall_ns=1_700_000_000_000_000_000)


def barrier(rank: int, start: float, answered: float, end: float) -> PhaseRecord:
    return PhaseRecord(
        node=0,
        rank=rank,
        phase="barrier",
        step=3,
        version=3,
        start=start,
        seconds=end - start,
        answered=answered,
        clock=CLOCK,
        figures={"trainer.held_mb": 0.0},
        trainer=(Span("barrier", start + 0.001, 0.002),),
        rollout=(Span("barrier", start + 0.001, 0.0001),),
    )


def sync(rank: int, start: float) -> PhaseRecord:
    """A SYNC whose trainer packed and sent two buckets (spans in the order they ended)."""
    at = start + 0.01
    return PhaseRecord(
        node=0,
        rank=rank,
        phase="sync",
        step=3,
        version=3,
        start=start,
        seconds=0.5,
        answered=start + 0.5,
        clock=CLOCK,
        figures={"trainer.bytes": 1 << 20, "trainer.digest": "ab"},
        trainer=(
            Span("sync", at, 0.4),
            Span("pack 0", at + 0.02, 0.05),
            Span("pack 1", at + 0.07, 0.05),
            Span("ACK 0", at + 0.12, 0.01),
            Span("ACK 1", at + 0.13, 0.05),
            Span("finalize", at + 0.18, 0.1),
            Span("send", at + 0.01, 0.3),
        ),
        rollout=(Span("sync", at, 0.41), Span("receive", at + 0.005, 0.4)),
    )


def test_a_phase_is_a_slice_on_both_tracks_of_its_rank_with_its_spans_inside() -> None:
    builder = TraceBuilder(origin_ns=CLOCK.wall_ns)
    events = builder.events(sync(1, start=101.0))
    check_events(events)
    check_timeline(events)
    slices = [e for e in events if e["ph"] == "X"]
    trainer = [e for e in slices if e["tid"] == track_of(1, "trainer")]
    assert [e["name"] for e in trainer] == [
        "SYNC", "sync", "send", "pack 0", "pack 1", "ACK 0", "ACK 1", "finalize"
    ]  # fmt: skip
    phase = trainer[0]
    assert phase["args"] == {
        "step": 3,
        "version": 3,
        "trainer.bytes": 1 << 20,
        "trainer.digest": "ab",
    }
    assert ns(phase["ts"]) == 1_000_000_000 and ns(phase["dur"]) == 500_000_000  # exact, in ns
    rollout = [e["name"] for e in slices if e["tid"] == track_of(1, "rollout")]
    assert rollout == ["SYNC", "sync", "receive"]
    names = {(e["name"], e["tid"]) for e in events if e["ph"] == "M"}
    assert names >= {("thread_name", track_of(1, "trainer")), ("process_name", 0)}
    # A track is named once: the next record on it brings no metadata.
    assert [e for e in builder.events(sync(1, start=102.0)) if e["ph"] == "M"] == []


def test_the_barrier_shows_the_wait_for_every_rank_after_both_workers_answered() -> None:
    events = TraceBuilder(CLOCK.wall_ns).events(barrier(0, start=101.0, answered=101.01, end=101.2))
    check_timeline(events)
    waits = [e for e in events if e["name"] == BARRIER_WAIT]
    assert len(waits) == 2 and {e["tid"] for e in waits} == {1, 2}
    assert all(ns(e["ts"]) == 1_010_000_000 and ns(e["dur"]) == 190_000_000 for e in waits)
    # Nobody to wait for: no wait slice.
    alone = TraceBuilder(CLOCK.wall_ns).events(barrier(0, 101.0, answered=101.2, end=101.2))
    assert not [e for e in alone if e["name"] == BARRIER_WAIT]


def test_marks_are_instants_on_the_drivers_track() -> None:
    mark = MarkRecord(node=2, name="command pause", at=100.5, clock=CLOCK, args={"generation": 4})
    events = TraceBuilder(CLOCK.wall_ns - 1_000).events(mark)
    check_events(events)
    (instant,) = [e for e in events if e["ph"] == "i"]
    assert instant == {
        "name": "command pause",
        "cat": "driver",
        "ph": "i",
        "s": "t",
        "ts": 500_001.0,  # 0.5 s after the clock's anchor, which is 1 µs after the origin
        "pid": 2,
        "tid": DRIVER_TID,
        "args": {"generation": 4},
    }


def test_nodes_line_up_by_their_wall_clocks() -> None:
    later = Clock(monotonic=5000.0, wall_ns=CLOCK.wall_ns + 2_000_000_000)  # another node
    on_node_1 = msgspec.structs.replace(sync(2, 5000.5), node=1, clock=later)
    records: list[Record] = [sync(0, 100.5), on_node_1]
    builder = TraceBuilder(min(r.clock.wall_ns for r in records))
    events = [e for r in records for e in builder.events(r)]
    starts = {e["pid"]: ns(e["ts"]) for e in events if e["name"] == "SYNC"}
    assert starts == {0: 500_000_000, 1: 2_500_000_000}


def test_the_file_written_as_records_come_is_the_one_written_at_once(tmp_path: Path) -> None:
    records: list[Record] = [
        MarkRecord(node=0, name="running", at=100.2, clock=CLOCK),
        sync(0, 101.0),
        barrier(0, 101.6, 101.61, 101.7),
    ]
    live = TraceFile(tmp_path / "live.json", CLOCK.wall_ns)
    for record in records:
        live.add(record)
    live.close()
    count = write_trace(records, tmp_path / "after.json")
    assert (tmp_path / "live.json").read_bytes() == (tmp_path / "after.json").read_bytes()
    events = load_trace(tmp_path / "live.json")
    assert len(events) == count
    check_events(events)
    check_timeline(events)


def test_a_trace_cut_off_by_a_crash_lacks_only_its_closing_bracket(tmp_path: Path) -> None:
    live = TraceFile(tmp_path / "cut.json", CLOCK.wall_ns)
    live.add(sync(0, 101.0))
    live.close()
    text = (tmp_path / "cut.json").read_text()
    assert text.endswith("\n]\n")
    events = json.loads(text[: -len("\n]\n")] + "]")  # what a crash leaves, closed by a reader
    check_events(events)


def test_records_read_back_from_log_lines_as_they_were() -> None:
    record = sync(0, 101.0)
    line = {
        "event": "cycle.phase.ended",
        "record": json.loads(json.dumps(msgspec.to_builtins(record))),
    }
    assert record_of_line(line) == record
    assert record_of_line({"event": "cycle.step.done"}) is None
    with pytest.raises(msgspec.ValidationError):
        record_of_line({"event": "cycle.moment.marked", "record": {"node": "zero"}})


def test_no_records_is_no_trace(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="nothing to trace"):
        write_trace([], tmp_path / "trace.json")
    assert not (tmp_path / "trace.json").exists()


def test_the_format_check_refuses_what_the_format_does_not_define() -> None:
    good = {"name": "SYNC", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 0, "tid": 1}
    check_events([good])
    for broken in (
        {**good, "dur": -1.0},
        {**good, "pid": "0"},
        {**good, "color": "red"},
        {**good, "ph": "B"},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {}},
    ):
        with pytest.raises(AssertionError):
            check_events([broken])
    overlapping = [good, {**good, "name": "half over", "ts": 2.0, "dur": 5.0}]
    with pytest.raises(AssertionError, match="without nesting"):
        check_timeline(overlapping)
    with pytest.raises(AssertionError, match="go back"):
        check_timeline([good, {**good, "ts": 0.5, "dur": 0.1}])


def test_a_loss_gone_to_nan_stays_visible_and_the_trace_stays_json() -> None:
    figures = TrainFigures(step=3, samples=4, loss=math.nan, reward_mean=math.inf)
    trainer = TrainResult(figures=figures)
    report = PhaseReport(3, 0, Phase.TRAIN, 100.0, 0.5, trainer, CommandResult(), answered=100.4)
    record = phase_record(report, node=0, clock=CLOCK)
    assert (record.figures["trainer.loss"], record.figures["trainer.reward_mean"]) == ("nan", "inf")
    assert record.figures["trainer.samples"] == 4 and record.answered == 100.4
    events = TraceBuilder(CLOCK.wall_ns).events(record)
    check_events(events)  # (plain JSON: no NaN)


def test_a_live_trace_keeps_the_one_an_earlier_process_left(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text("[\n{cut short by a crash")
    live = TraceFile(path, CLOCK.wall_ns)
    live.add(sync(0, 101.0))
    live.close()
    assert previous_of(path).read_text() == "[\n{cut short by a crash"
    check_events(load_trace(path))


def test_a_record_the_writer_cannot_write_ends_the_live_trace_not_the_run(
    tmp_path: Path,
) -> None:
    live = TraceFile(tmp_path / "trace.json", CLOCK.wall_ns)
    live.add(sync(0, 101.0))
    live.add(MarkRecord(node=0, name="bad", at=100.0, clock=CLOCK, args={"x": math.nan}))
    live._thread.join(10)  # the writer stopped, having closed the file whole
    assert not live._thread.is_alive()
    live.add(sync(0, 102.0))  # refused quietly: nothing queues up for days
    assert live._queue.empty()
    live.close()
    names = {e["name"] for e in load_trace(tmp_path / "trace.json")}
    assert "SYNC" in names and "bad" not in names


def test_a_live_trace_past_its_size_starts_a_new_file_each_whole_and_named(
    tmp_path: Path,
) -> None:
    """[log] max_mb: every generation is a whole JSON array whose tracks are named in it, no
    event is lost while `keep` allows, and none older than `keep` generations is kept."""
    path = tmp_path / "trace.json"
    records = [sync(rank, 101.0 + step) for step in range(12) for rank in (0, 1)]
    live = TraceFile(path, CLOCK.wall_ns, max_bytes=4096, keep=100)
    for record in records:
        live.add(record)
    live.close()
    files = rotated_paths(path)
    assert len(files) > 3
    slices = 0
    for file in files:
        events = load_trace(file)
        check_events(events)
        check_timeline(events)
        named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {e["tid"] for e in events if e["ph"] == "X"} <= named, file
        slices += sum(e["ph"] == "X" for e in events)
    assert slices == sum(e["ph"] == "X" for e in load_trace_of(records, tmp_path))

    kept = TraceFile(tmp_path / "kept.json", CLOCK.wall_ns, max_bytes=4096, keep=2)
    for record in records:
        kept.add(record)
    kept.close()
    assert [p.name for p in rotated_paths(tmp_path / "kept.json")] == [
        "kept.json.2",
        "kept.json.1",
        "kept.json",
    ]


def load_trace_of(records: list[PhaseRecord], directory: Path) -> list[dict[str, object]]:
    write_trace(list(records), directory / "whole.json")
    return load_trace(directory / "whole.json")


def test_a_sync_into_a_tp_engine_shows_what_each_worker_loaded() -> None:
    transfer = TransferReport(version=3, bytes=4096, tensors=2, buckets=1, seconds=0.1)
    workers = [WorkerLoad(0, 4096, "d"), WorkerLoad(1, 4096, "d")]
    trainer = SyncResult(transfer=transfer, digest="d", receivers=2)
    rollout = SyncResult(transfer=transfer, digest="d", workers=workers)
    report = PhaseReport(3, 0, Phase.SYNC, 100.0, 0.5, trainer, rollout, answered=100.4)
    figures = phase_record(report, node=0, clock=CLOCK).figures
    assert (figures["trainer.bytes"], figures["trainer.receivers"]) == (4096, 2)
    assert figures["rollout.worker0.bytes"] == figures["rollout.worker1.bytes"] == 4096
    assert figures["rollout.worker1.digest"] == "d"
