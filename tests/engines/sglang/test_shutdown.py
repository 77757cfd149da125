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
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from tests.engines.foreign_hosts import left_in_shm, shm_names
from tests.engines.sglang.conftest import MODEL, spec
from timeshare.engines.sglang.engine import SglangRollout
from timeshare.runtime import children_of, is_resource_tracker, running_since, wait_gone

pytestmark = pytest.mark.slow


def test_closing_an_engine_ends_its_processes_and_no_other_child_of_its_host(
    runtime_dir: Path,
) -> None:
    shm_before = shm_names()
    resource_tracker.ensure_running()  # this process's, as every rollout worker's
    [tracker] = [pid for pid in children_of(os.getpid()) if is_resource_tracker(pid)]
    # another child of the host, started before the engine
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
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
