"""CpuWait on real processes: the time a worker's process tree waited for a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from timeshare.protocols.commands.cpu_wait import CpuWait, process_cpu_wait_ns

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_children_that_wait_for_a_cpu_are_counted_and_an_idle_tree_is_not() -> None:
    idle = CpuWait()
    time.sleep(1.0)
    assert idle.since_last() < 0.2  # this process, sleeping: nothing waited
    cores = len(os.sched_getaffinity(0))
    # Twice as many spinning children as cores: each waits for a CPU about half the time.
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 * cores)]
    try:
        time.sleep(1.0)  # (they start)
        starved = CpuWait()
        assert starved.measured
        time.sleep(2.0)
        waited = starved.since_last()
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    assert 0.4 < waited <= 2.5, waited  # about 1 s of 2: the largest wait of one thread


def test_a_process_that_is_gone_reads_as_no_wait() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    watched = CpuWait(process.pid)
    process.wait()
    assert watched.since_last() == 0.0


def test_the_processes_own_threads_are_summed_from_the_same_scan() -> None:
    watched = CpuWait()
    watched.since_last()
    # As process_cpu_wait_ns reads it for the driver; a moment later it can only have grown.
    assert 0 <= watched.own_ns <= process_cpu_wait_ns(os.getpid())
