"""Closing an SGLang engine ends its own processes and nothing else its host started.

SGLang's own shutdown SIGKILLs every descendant of the process that hosts the engine
(own_shutdown.py): Python's resource tracker among them, which must outlive SGLang's processes
to unlink their semaphores, and any other engine of the same host (a CI run of the contract
tests saw the shared TP-2 engine fail as the shared TP-1 one closed). Here the host is this
process, with a resource tracker and another child of its own, as a rollout worker has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from tests.engines.foreign_hosts import left_in_shm, shm_names
from tests.engines.sglang.conftest import MODEL, spec
from timeshare.engines.sglang.engine import SglangRollout
from timeshare.engines.sglang.own_shutdown import ending, narrow
from timeshare.runtime import children_of, is_resource_tracker, running_since, wait_gone


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def this_process_tracker() -> int:
    """This process's resource tracker, as every rollout worker has one (started, and exec'd:
    forked, it shows this process's command line a moment)."""
    resource_tracker.ensure_running()
    deadline = time.monotonic() + 30
    while True:
        trackers = [pid for pid in children_of(os.getpid()) if is_resource_tracker(pid)]
        if trackers:
            [tracker] = trackers
            return tracker
        assert time.monotonic() < deadline, "no resource tracker started"
        time.sleep(0.01)


def test_the_narrowed_kill_ends_the_engine_ending_and_never_a_resource_tracker() -> None:
    """own_shutdown.narrow on a stand-in of SGLang's module: the call SGLang's shutdown makes
    (this process's descendants, not itself) kills the ending engine's processes; with none
    ending (interpreter exit), every descendant but the tracker; any other call is SGLang's."""
    tracker = this_process_tracker()
    passed_on: list[tuple[object, ...]] = []
    module = types.ModuleType("stand_in")
    vars(module)["kill_process_tree"] = lambda *args: passed_on.append(args)
    narrow(module)
    engine, other = sleeper(), sleeper()
    try:
        with ending([engine.pid]):
            module.kill_process_tree(os.getpid(), include_parent=False, wait_timeout=30)
        # (killed and reaped: Popen sees no status of its own any more)
        assert running_since(engine.pid) is None and running_since(other.pid) is not None
        module.kill_process_tree(os.getpid(), include_parent=False, wait_timeout=30)
        assert running_since(other.pid) is None
        assert running_since(tracker) is not None
        module.kill_process_tree(os.getpid())  # SGLang killing itself as it fails: its own
        module.kill_process_tree(12345, include_parent=False)  # another's tree: its own
        assert passed_on == [(os.getpid(), True, None, 60), (12345, False, None, 60)]
    finally:
        for process in (engine, other):
            process.kill()
            process.wait(timeout=30)


@pytest.mark.slow
def test_closing_an_engine_ends_its_processes_and_no_other_child_of_its_host(
    runtime_dir: Path,
) -> None:
    shm_before = shm_names()
    tracker = this_process_tracker()
    other = sleeper()  # another child of the host, started before the engine
    try:
        engine = SglangRollout(0, spec(), MODEL, 120.0, runtime_dir)
        try:
            own = engine.own_processes()
            assert other.pid not in own and tracker not in own
            assert len(own) >= 2, own  # its scheduler and detokenizer at least
        finally:
            engine.close()
        assert wait_gone(own, 30) == []
        assert other.poll() is None, "SGLang's shutdown killed another child of its host"
        assert running_since(tracker) is not None, "SGLang's shutdown killed the tracker"
    finally:
        other.kill()
        other.wait(timeout=30)
    assert left_in_shm(shm_before) == []
