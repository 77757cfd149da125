"""tests/starving.py, the instrument the starvation tests prove their starvation with: a process
starved while it wants a CPU is measured as waiting (the children it starts included), one that
wants none is not, and a process the cgroup refuses skips the test naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.starving import PROC, _cgroup, cpu_starved

# Spins from 0.5 s on in a child it starts then: what a process starts in the block is starved.
SPINS_IN_A_CHILD = (
    "import subprocess, sys, time\n"
    "time.sleep(0.5)\n"
    "subprocess.run([sys.executable, '-c', 'while True: pass'])\n"
)
PF_KTHREAD = 0x00200000


def test_a_child_that_wants_a_cpu_waits_and_a_sleeping_process_does_not() -> None:
    # Each in a process group of its own, killed whole: the spinning child too (left, it spun
    # for the rest of the session, half a core of a two-core machine).
    spinning = subprocess.Popen([sys.executable, "-c", SPINS_IN_A_CHILD], start_new_session=True)
    sleeping = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        with cpu_starved([spinning.pid], 0.1) as starved:
            time.sleep(3.0)  # the child spins most of it, on a tenth of a CPU
        with cpu_starved([sleeping.pid], 0.1) as idle:
            time.sleep(1.0)
    finally:
        for process in (spinning, sleeping):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert starved.waited_s > 1.0, starved
    if starved.throttled_s is not None:  # (a cgroup's quota, not spinning beside it)
        assert starved.throttled_s > 0.5, starved
    assert idle.waited_s < 0.2, idle


def test_a_process_the_cgroup_refuses_skips_the_test_naming_it() -> None:
    """A kernel thread cannot join a cgroup: the block does not run it unstarved."""
    group = _cgroup()
    if group is None:
        pytest.skip("no cgroup with a CPU quota can be made here (not root, or no controller)")
    group[0].rmdir()
    kernel_thread = next((pid for pid in _pids() if _flags(pid) & PF_KTHREAD), None)
    if kernel_thread is None:
        pytest.skip("no kernel thread is visible here (a PID namespace)")
    with pytest.raises(pytest.skip.Exception, match=f"process {kernel_thread} could not be"):
        with cpu_starved([kernel_thread], 0.5):
            pytest.fail("the block ran, the process unstarved")


def _pids() -> list[int]:
    return sorted(int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit())


def _flags(pid: int) -> int:
    """The process's flags (/proc/<pid>/stat's ninth field; the name before it may hold
    spaces), 0 for one that is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0
    return int(stat.rpartition(")")[2].split()[6])
