"""How idle a worker's heartbeat says its call is: the worker's own clock, in-process (the
real processes are tests/protocols/test_commands.py)."""

from __future__ import annotations

import time

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
    server._busy = frames.Call(7, "train", {})
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


def test_time_the_process_was_held_up_is_not_the_calls_idleness() -> None:
    server = busy_server()
    server._progress_at = time.monotonic() - 3.5  # idle 0.5 s, then paused 3 s
    # The control thread's 0.05 s wait began 3 s ago: the process (or VM) was paused.
    server._forgive_lateness(time.monotonic() - 3.0, 0.05)
    assert 0.4 <= server._heartbeat().idle_s < 1.0
    server._progress_at = time.monotonic() - 0.5
    server._forgive_lateness(time.monotonic() - 3.0, 0.05)  # a pause longer than the idleness
    assert 0.0 <= server._heartbeat().idle_s < 0.2  # forgives it, and no more
    server._progress_at = time.monotonic() - 0.5
    server._forgive_lateness(time.monotonic() - 0.3, 0.05)  # on time: nothing forgiven
    assert server._heartbeat().idle_s >= 0.5
