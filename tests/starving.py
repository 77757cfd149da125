"""Starving processes of CPU for a test, as a loaded machine or a CPU quota would: a cgroup's
CPU quota (v1 or v2, as root), which the kernel counts as time waiting for a CPU; where no
cgroup can be made, processes spinning beside them on the same CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")  # the cpu controller's own hierarchy
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
SPIN = "while True: pass"


@contextmanager
def cpu_starved(pids: list[int], fraction: float) -> Iterator[str]:
    """`pids` (and what they start from now on) get `fraction` of one CPU between them, until
    the block ends; yields how ("cgroup v1", "cgroup v2" or "spinning")."""
    group = _cgroup()
    if group is None:
        with _spinning_beside(pids, fraction):
            yield "spinning"
        return
    path, version = group
    try:
        quota = max(1000, int(PERIOD_US * fraction))
        if version == "cgroup v1":
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        for pid in pids:
            _move(pid, path / "cgroup.procs")
        yield version
    finally:
        parent = path.parent / "cgroup.procs"
        for member in (path / "cgroup.procs").read_text().split():
            _move(int(member), parent)  # back, so that the group can go
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


def _move(pid: int, procs: Path) -> None:
    with suppress(ProcessLookupError, OSError):  # (it exited meanwhile)
        procs.write_text(str(pid))


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
