"""Starving processes of CPU for a test, as a loaded machine or a CPU quota would: a cgroup's
CPU quota (v1 or v2, as root), which the kernel counts as time waiting for a CPU; where no
cgroup can be made, processes spinning beside them on the same CPUs.

A test shows the starvation it relies on: the block yields a `Starving`, which after the block
says how long the processes (and every process they started) waited for a CPU, read from the
kernel's schedstat as cpu_wait.py reads it, and how long a cgroup's quota throttled them. Where
the processes cannot be starved (the cgroup refuses a process or the quota, or the kernel keeps
no schedstat, so that no wait is measured nor left out of a worker's silence), the test is
skipped naming why: it never passes unstarved."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/cpu")  # the cpu controller's own hierarchy
V2 = Path("/sys/fs/cgroup")
PROC = Path("/proc")
PERIOD_US = 100_000
SPIN = "while True: pass"
SAMPLE_S = 0.25  # how often the threads' waits are read (a thread's last moments are lost)


@dataclass
class Starving:
    """How the processes were starved; after the block, what it did to them."""

    how: str  # "cgroup v1", "cgroup v2" or "spinning"
    # The longest any one thread of the processes waited for a CPU during the block, in all.
    waited_s: float = 0.0
    throttled_s: float | None = None  # how long the cgroup's quota held them back
    _waits: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # ns a thread
    _last: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def __str__(self) -> str:
        throttled = "" if self.throttled_s is None else f", throttled {self.throttled_s:.1f} s"
        return f"{self.how}: a thread waited {self.waited_s:.1f} s for a CPU{throttled}"


@contextmanager
def cpu_starved(pids: list[int], fraction: float) -> Iterator[Starving]:
    """`pids` (and what they start from now on) get `fraction` of one CPU between them, until
    the block ends; yields how, and once the block has ended how long they waited."""
    if not (PROC / "self" / "schedstat").exists():
        pytest.skip("this kernel keeps no schedstat: a wait for a CPU is not measured here")
    group = _cgroup()
    if group is None:
        starving = Starving("spinning")
        with _spinning_beside(pids, fraction), _measured(starving, pids):
            yield starving
        return
    path, version = group
    starving = Starving(version)
    try:
        quota = max(1000, int(PERIOD_US * fraction))
        try:
            if version == "cgroup v1":
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        except OSError as error:
            pytest.skip(f"{version}: {path} takes no CPU quota ({error}): nothing is starved")
        for pid in pids:
            _move(pid, path / "cgroup.procs", version)
        with _measured(starving, pids):
            yield starving
    finally:
        starving.throttled_s = _throttled_s(path)
        parent = path.parent / "cgroup.procs"
        for member in (path / "cgroup.procs").read_text().split():
            with suppress(OSError):  # (it exited meanwhile)
                parent.write_text(member)  # back, so that the group can go
        with suppress(OSError):
            path.rmdir()


def _cgroup() -> tuple[Path, str] | None:
    name = f"timeshare-test-{uuid.uuid4().hex[:8]}"
    for root, version, control in (
        (V1, "cgroup v1", "cpu.cfs_quota_us"),
        (V2, "cgroup v2", "cpu.max"),
    ):
        try:
            (root / name).mkdir()
        except OSError:
            continue
        if (root / name / control).exists():
            return root / name, version
        (root / name).rmdir()
    return None


def _move(pid: int, procs: Path, version: str) -> None:
    """Into the group, or the test is skipped: a process left out would run unstarved."""
    try:
        procs.write_text(str(pid))
    except ProcessLookupError:  # it exited meanwhile: nothing of it to starve
        pass
    except OSError as error:
        pytest.skip(f"{version}: process {pid} could not be moved into {procs.parent} ({error})")


def _throttled_s(group: Path) -> float | None:
    """The group's throttled time (cpu.stat: v1 in ns, v2 in µs), None where unread."""
    try:
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if "throttled_time" in stat:
        return int(stat["throttled_time"]) * 1e-9
    if "throttled_usec" in stat:
        return int(stat["throttled_usec"]) * 1e-6
    return None


@contextmanager
def _measured(starving: Starving, pids: list[int]) -> Iterator[None]:
    """Reads every thread of `pids`' process trees every SAMPLE_S while the block runs."""
    done = threading.Event()

    def sample() -> None:
        while True:
            _sample(starving, pids)
            if done.wait(SAMPLE_S):
                return

    sampler = threading.Thread(target=sample, name="starving-sampler", daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        _sample(starving, pids)  # up to the end of the block


def _sample(starving: Starving, pids: list[int]) -> None:
    """Adds what each thread waited since it was last read (one first seen counts from now)."""
    for tid, delay in _run_delays(pids).items():
        last = starving._last.get(tid, delay)
        waited = delay - last if delay >= last else delay  # (a tid reused by a new thread)
        starving._waits[tid] = starving._waits.get(tid, 0) + waited
        starving._last[tid] = delay
    starving.waited_s = max(starving._waits.values(), default=0) * 1e-9


def _run_delays(pids: list[int]) -> dict[int, int]:
    """Every thread of the trees under `pids`: its run_delay so far (schedstat), in ns."""
    delays: dict[int, int] = {}
    pending, seen = list(pids), set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        with suppress(OSError):  # it exited meanwhile
            for task in (PROC / str(pid) / "task").iterdir():
                with suppress(OSError, IndexError, ValueError):
                    delays[int(task.name)] = int((task / "schedstat").read_text().split()[1])
                with suppress(OSError, ValueError):
                    pending.extend(int(p) for p in (task / "children").read_text().split())
    return delays


@contextmanager
def _spinning_beside(pids: list[int], fraction: float) -> Iterator[None]:
    cpus = sorted(os.sched_getaffinity(pids[0] if pids else 0))
    per_cpu = max(1, round(1 / fraction) - 1)
    spinning = []
    try:
        for cpu in cpus:
            for _ in range(per_cpu):
                process = subprocess.Popen([sys.executable, "-c", SPIN])
                os.sched_setaffinity(process.pid, {cpu})
                spinning.append(process)
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()
