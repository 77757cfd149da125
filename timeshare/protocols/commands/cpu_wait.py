"""How long a worker's threads, and those of the processes under it (an engine's own processes:
vLLM's engine core and TP workers, SGLang's schedulers), waited for a CPU while runnable.

Linux counts it per thread in /proc/<pid>/task/<tid>/schedstat (its second field, run_delay, in
ns), and counts a CPU quota's throttled time there too. Time a thread waited for a CPU is the
machine's, not the call's (state/stall.py). For the worker's idleness, `CpuWait.since_last()`
says how much of it passed since it was last asked, as the largest wait of any one thread:
threads that waited together are one wait, not their sum. For the driver's silence rule,
`process_cpu_wait_ns` sums one process's threads.

Where the kernel keeps no schedstat (not Linux, or built without CONFIG_SCHED_INFO) nothing is
measured and every wait reads 0: a starved worker is then judged as if it ran.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
NS = 1e-9


class CpuWait:
    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.measured = (PROC / str(self.pid) / "schedstat").exists()
        # The process's own threads' run_delay, summed, as the last scan read it: what its
        # heartbeat tells the driver (process_cpu_wait_ns's figure, without a second read).
        self.own_ns = 0
        self._last: dict[int, int] = self._run_delays() if self.measured else {}

    def since_last(self) -> float:
        """Seconds the longest-waiting thread of the tree waited for a CPU since the last call
        (a thread new since then is counted from now on)."""
        if not self.measured:
            return 0.0
        delays = self._run_delays()
        last = self._last
        waited = max((ns - last[tid] for tid, ns in delays.items() if tid in last), default=0)
        self._last = delays
        return max(0, waited) * NS

    def _run_delays(self) -> dict[int, int]:
        """Every thread of the process tree: its run_delay so far, in ns."""
        delays: dict[int, int] = {}
        pending = [self.pid]
        while pending:
            pid = pending.pop()
            for task in _tasks(pid):
                delay = _run_delay(task)
                if delay is not None:
                    delays[int(task.name)] = delay
                pending.extend(_children(task))
            if pid == self.pid:
                self.own_ns = sum(delays.values())  # (its threads are the first read)
        return delays


def process_cpu_wait_ns(pid: int) -> int:
    """The run_delay of every thread of process `pid` (not of its children), summed: how long
    they have waited for a CPU so far, in ns (0 for a process that is gone, or where the kernel
    keeps no schedstat). For the driver: a worker's silence spent waiting for a CPU is the
    machine's, not the worker's."""
    return sum(delay for task in _tasks(pid) if (delay := _run_delay(task)) is not None)


def _tasks(pid: int) -> list[Path]:
    try:
        return list((PROC / str(pid) / "task").iterdir())
    except OSError:  # it exited meanwhile
        return []


def _run_delay(task: Path) -> int | None:
    try:
        return int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _children(task: Path) -> list[int]:
    try:
        return [int(pid) for pid in (task / "children").read_text().split()]
    except (OSError, ValueError):  # (no CONFIG_PROC_CHILDREN: this process's threads alone)
        return []
