"""Ending a worker's process group (runtime.py `end_groups`), with real processes: a group whose
leader starts a child with spawn, as vLLM and SGLang start theirs, so that Python's resource
tracker runs in the group; the child makes a named semaphore (/dev/shm/sem.mp-*) and never
unlinks it, as a process killed before its finalizers ran does. The tracker unlinks it once the
processes it serves are gone, if it is still alive then."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.protocols.weights.peers import wait_until
from timeshare.runtime import (
    SHM_ROOT,
    end_groups,
    group_members,
    is_resource_tracker,
    kill_group,
    wait_gone,
)

# The group's leader: a spawned child makes a semaphore, writes its name, and waits to be killed.
LEADER = """
import multiprocessing, sys, time

def hold_a_semaphore(path):
    lock = multiprocessing.get_context("spawn").Lock()
    with open(path + ".partial", "w") as out:
        out.write(lock._semlock.name)
    import os
    os.replace(path + ".partial", path)
    time.sleep(600)

if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=hold_a_semaphore, args=(sys.argv[1],))
    child.start()
    time.sleep(600)
"""


def start_group(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A process group of a leader, its spawned child and their resource tracker; the
    semaphore the child holds, once it exists."""
    said = tmp_path / "semaphore"
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    leader = subprocess.Popen([sys.executable, str(script), str(said)], start_new_session=True)
    try:
        assert wait_until(said.exists, timeout=60), "the child made no semaphore"
        semaphore = SHM_ROOT / f"sem.{said.read_text().lstrip('/')}"
        assert semaphore.exists()
        members = group_members({leader.pid})
        assert len(members) == 3  # the leader, its child, the tracker
        assert sum(map(is_resource_tracker, members)) == 1
    except BaseException:
        kill_group(leader.pid)
        leader.wait(timeout=30)
        raise
    return leader, semaphore


def ended_by(ending: Callable[[list[int]], None], tmp_path: Path) -> Path:
    """Start a group, end it with `ending`; the semaphore its child held."""
    leader, semaphore = start_group(tmp_path)
    members = group_members({leader.pid})
    try:
        ending([leader.pid])
        leader.wait(timeout=30)
        assert wait_gone(members, 30) == []
    finally:
        kill_group(leader.pid)
        leader.wait(timeout=30)
    return semaphore


def test_ending_a_group_lets_its_resource_tracker_unlink_what_the_killed_left(
    tmp_path: Path,
) -> None:
    semaphore = ended_by(end_groups, tmp_path)
    deadline = time.monotonic() + 10
    while semaphore.exists():  # (unlinked before the tracker exits: wait_gone saw it gone)
        assert time.monotonic() < deadline, f"{semaphore} stayed"
        time.sleep(0.05)


def kill_each(pgids: list[int]) -> None:
    for pgid in pgids:
        kill_group(pgid)


def test_killing_a_group_whole_leaves_the_semaphores_for_good(tmp_path: Path) -> None:
    """Why: what `end_groups` does instead of `kill_group` alone."""
    semaphore = ended_by(kill_each, tmp_path)
    try:
        time.sleep(1.0)
        assert semaphore.exists()
    finally:
        semaphore.unlink(missing_ok=True)
