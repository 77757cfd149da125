"""cpu_wait.py on real processes: what a worker's process tree did with the CPUs, and how long
the machine kept it from them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from timeshare.protocols.commands.cpu_wait import (
    cpu_wait_between,
    cpu_wait_since,
    cpus,
    tree_cpu_time,
)

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_an_idle_tree_waits_for_nothing() -> None:
    then = tree_cpu_time(os.getpid())
    time.sleep(1.0)
    # This process, sleeping: nothing waited.
    assert cpu_wait_since(os.getpid(), then, 1.0) < 0.2


def test_every_thread_of_the_tree_is_read_its_childrens_too() -> None:
    count = 2 * cpus(os.getpid())
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(1.0)  # (they start)
        then, started = tree_cpu_time(os.getpid()), time.monotonic()
        time.sleep(2.0)
        now, took_s = tree_cpu_time(os.getpid()), time.monotonic() - started
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    ran_s, waited_s = (now.ran_ns - then.ran_ns) * 1e-9, (now.waited_ns - then.waited_ns) * 1e-9
    # Each child wanted a CPU all along, and ran or waited for one, however loaded the machine;
    # between them they ran no longer than the CPUs they may run on give.
    assert 0.8 * count * took_s < ran_s + waited_s < 1.1 * count * took_s + 0.5, (ran_s, waited_s)
    assert ran_s < 1.05 * cpus(os.getpid()) * took_s, ran_s


def test_a_process_kept_from_its_cpu_by_others_is_forgiven_its_wait() -> None:
    """One spinning process of many beside it on the same CPUs (none of them under it): it
    waits for a CPU about two thirds of the time, or more on a loaded machine, and that is the
    machine's."""
    count = 3 * cpus(os.getpid())
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(1.0)  # (they start)
        then, started = tree_cpu_time(spinning[0].pid), time.monotonic()
        time.sleep(2.0)
        waited_s = cpu_wait_since(spinning[0].pid, then, time.monotonic() - started)
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    assert 0.6 < waited_s <= 2.1, waited_s  # about 1.3 s of 2: its own wait, once


def test_a_process_that_is_gone_reads_as_no_wait() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    then = tree_cpu_time(process.pid)
    process.wait()
    assert tree_cpu_time(process.pid) == (0, 0)
    assert cpu_wait_since(process.pid, then, 1.0) == 0.0


def test_a_thread_that_ended_takes_its_counts_with_it_and_reads_as_no_less_than_zero() -> None:
    then = tree_cpu_time(os.getpid())
    gone = then._replace(ran_ns=then.ran_ns + 10**9, waited_ns=then.waited_ns + 10**9)
    assert cpu_wait_between(gone, then, 1.0, 2) == 0.0
