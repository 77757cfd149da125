"""How idle a worker's heartbeat says its call is: the worker's own clock, in-process (the
real processes are tests/protocols/test_commands.py)."""

from __future__ import annotations

import time

import msgspec

from timeshare.protocols.commands import WorkerServer, frames


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
    server._progress_mark = (time.monotonic() - 5.0, 0.0)
    assert server._heartbeat().idle_s >= 5.0
    server.report_progress()
    assert server._heartbeat().idle_s < 1.0


def test_a_wait_on_the_peer_counts_as_progress_up_to_its_end() -> None:
    server = busy_server()
    server._progress_mark = (time.monotonic() - 60.0, 0.0)  # the wait began a minute ago
    with server.waiting_on_peer():
        assert server._heartbeat().idle_s == 0.0
    assert server._heartbeat().idle_s < 1.0  # the wait counted as progress up to its end


def test_the_machines_time_since_the_last_progress_is_not_the_calls_idleness() -> None:
    server = busy_server()
    server._machine_s = 10.0  # (the machine's time before the last progress: not this call's)
    server._progress_mark = (time.monotonic() - 3.5, 10.0)  # idle 0.5 s, then 3 s held up
    server._machine_s = 13.0  # as the control thread adds it up (state/stall.py)
    assert 0.4 <= server._heartbeat().idle_s < 1.0
    server.report_progress()  # from here on, the machine's earlier time counts for nothing
    server._progress_mark = (time.monotonic() - 2.0, 13.0)
    assert server._heartbeat().idle_s >= 2.0
