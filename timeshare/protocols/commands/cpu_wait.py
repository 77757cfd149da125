"""How long a worker's process tree (its threads, and those of the processes under it: an
engine's own processes, vLLM's engine core and TP workers, SGLang's schedulers) was kept from a
CPU: what state/stall.py's `cpu_wait_s` leaves out of a call's idleness and of its silence.

Linux counts per thread, in /proc/<pid>/task/<tid>/schedstat, the time it ran on a CPU (the
first field) and the time it waited for one while runnable (the second, run_delay, which
counts a CPU quota's throttled time too), in ns. A `CpuTime` is the tree's threads' two sums
as one scan read them; the wait over a stretch is the rule applied to how much they grew, on
the CPUs the tree may run on (`cpu_wait_between`). The worker reads its tree at every
heartbeat, judges the stretch since its call's last progress, and sends the sums it read; a
driver that hears nothing for a while reads the tree again and judges the stretch since that
heartbeat (`cpu_wait_since`): one reading, one rule, on both sides.

The kernel adds a wait to run_delay once the thread gets its CPU: a reading misses the waits
still going on, which the next one counts whole. The sums are of the threads there at each
reading: a thread or process that ended meanwhile takes its counts with it, so a growth is read
as no less than zero, and a new one counts whole (all its time is in the stretch). Where the
kernel keeps no schedstat (not Linux, or built without CONFIG_SCHED_INFO) every sum reads 0 and
so does every wait: a starved worker is then judged as if it ran.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from timeshare.state.stall import cpu_wait_s

PROC = Path("/proc")
NS = 1e-9


class CpuTime(NamedTuple):
    """A process tree's threads' time on a CPU and waiting for one, summed, so far (ns)."""

    ran_ns: int
    waited_ns: int


def tree_cpu_time(pid: int) -> CpuTime:
    """Every thread of process `pid` and of the processes under it, summed (0, 0 for a process
    that is gone, or where the kernel keeps no schedstat)."""
    ran = waited = 0
    pending, seen = [pid], set()
    while pending:
        process = pending.pop()
        if process in seen:
            continue
        seen.add(process)
        for task in _tasks(process):
            stat = _schedstat(task)
            if stat is not None:
                ran, waited = ran + stat[0], waited + stat[1]
            pending.extend(_children(task))
    return CpuTime(ran, waited)


def cpus(pid: int) -> int:
    """How many CPUs process `pid` may run on (this process's where it is gone)."""
    try:
        return len(os.sched_getaffinity(pid))
    except OSError:
        return len(os.sched_getaffinity(0))


def cpu_wait_between(then: CpuTime, now: CpuTime, stretch_s: float, on_cpus: int) -> float:
    """Seconds of a stretch of `stretch_s` that the machine kept a tree from a CPU, from its
    CpuTime at its start and end (state/stall.py's rule)."""
    ran_ns = max(0, now.ran_ns - then.ran_ns)
    waited_ns = max(0, now.waited_ns - then.waited_ns)
    return cpu_wait_s(stretch_s, ran_ns * NS, waited_ns * NS, on_cpus)


def cpu_wait_since(pid: int, then: CpuTime, stretch_s: float) -> float:
    """Seconds of the last `stretch_s` that the machine kept `pid`'s tree from a CPU, read
    against `then`, its CpuTime that long ago."""
    return cpu_wait_between(then, tree_cpu_time(pid), stretch_s, cpus(pid))


def _tasks(pid: int) -> list[Path]:
    try:
        return list((PROC / str(pid) / "task").iterdir())
    except OSError:  # it exited meanwhile
        return []


def _schedstat(task: Path) -> tuple[int, int] | None:
    """The thread's time on a CPU and its run_delay so far, in ns."""
    try:
        fields = (task / "schedstat").read_text().split()
        return int(fields[0]), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _children(task: Path) -> list[int]:
    try:
        return [int(pid) for pid in (task / "children").read_text().split()]
    except (OSError, ValueError):  # (no CONFIG_PROC_CHILDREN: this process's threads alone)
        return []
