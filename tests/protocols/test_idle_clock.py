"""How idle a worker's heartbeat says its call is: the worker's own clock, in-process (the
real processes are tests/protocols/test_commands.py)."""

from __future__ import annotations

import time

import msgspec
import pytest

from timeshare.protocols.commands import WorkerServer, frames
from timeshare.protocols.commands.cpu_wait import CpuTime
from timeshare.protocols.commands.worker_side import Reading

MS = 1_000_000  # ns


def busy_server() -> WorkerServer:
    """A server in the middle of a call (never served: no socket is opened)."""
    server = WorkerServer(
        work_endpoint="ipc:///nowhere/work.sock",
        control_endpoint="ipc:///nowhere/control.sock",
        role="trainer",
        rank=0,
        handlers={},
    )
    server._busy = frames.Call(7, "train", msgspec.Raw(b"\x80"))
    return server


def test_a_call_without_progress_grows_idle_and_progress_resets_it() -> None:
    server = busy_server()
    server._progress_at = time.monotonic() - 5.0
    assert server._heartbeat().idle_s >= 5.0
    server.report_progress()
    assert server._heartbeat().idle_s < 1.0


def test_a_wait_on_the_peer_counts_as_progress_up_to_its_end() -> None:
    server = busy_server()
    server._progress_at = time.monotonic() - 60.0  # the wait began a minute ago
    with server.waiting_on_peer():
        assert server._heartbeat().idle_s == 0.0
    assert server._heartbeat().idle_s < 1.0  # the wait counted as progress up to its end


def test_the_machines_time_since_the_last_progress_is_not_the_calls_idleness() -> None:
    server = busy_server()
    start = time.monotonic()
    server._measure(Reading(start - 1.0, CpuTime(0, 0), 7.0))  # (held up 7 s before)
    server._progress_at = start - 0.5  # then the first reading after it, and 3 s held up
    server._measure(Reading(start, CpuTime(0, 0), 10.0))
    server._measure(Reading(start + 3.0, CpuTime(0, 0), 13.0))
    assert server._heartbeat(start + 3.0).idle_s == pytest.approx(0.5)
    # Progress: from here on, the machine's earlier time counts for nothing. Its stretch starts
    # at the first reading after it (the machine's time before that reading is the call's).
    server._progress_at = start + 3.1
    server._measure(Reading(start + 3.2, CpuTime(0, 0), 14.0))
    server._measure(Reading(start + 5.2, CpuTime(0, 0), 14.0))
    assert server._heartbeat(start + 5.2).idle_s == pytest.approx(2.1)


def test_the_cpu_wait_is_judged_over_the_stretch_whole() -> None:
    """The kernel counts a thread's wait for a CPU once it has ended: here the call's thread,
    on a tenth of a CPU, has its 0.9 s of waits counted one reading late. Judged reading by
    reading, each stretch capped at its own length, 0.43 s of it would be lost (idle 0.54 s);
    over the stretch whole, all of it is the machine's."""
    server = busy_server()
    start = time.monotonic()
    server._measure(Reading(start - 0.5, CpuTime(0, 0), 0.0))
    server._progress_at = start - 0.01
    for at, ran_ms, waited_ms in [(0.0, 0, 0), (0.5, 50, 0), (1.0, 100, 900)]:
        server._measure(Reading(start + at, CpuTime(ran_ms * MS, waited_ms * MS), 0.0))
    assert server._heartbeat(start + 1.0).idle_s == pytest.approx(0.11)
