"""The autouse leak check (conftest.no_leaked_staging) blames a test only for its own segments.

Segment files are made here by hand, with the names timeshare gives (segments.py), and each is
removed by the test or fixture that made it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    directory_tags,
    own_processes,
    segments_of_this_test,
    staging_segments,
)
from timeshare.protocols.weights.segments import SEGMENT_PREFIX, staging_tag
from timeshare.runtime import SHM_ROOT, process_start_time

FOREIGN_PID = 1  # init: alive, and never a descendant of the test run


def segment_name(tag: str, pid: int, session: int) -> str:
    start = process_start_time(pid)
    assert start is not None, f"no process {pid}"
    return f"{SEGMENT_PREFIX}{tag}-{pid}-{start}-{session:016x}-0"


def make_segment(name: str) -> Path:
    path = SHM_ROOT / name
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return path


@pytest.fixture(scope="module")
def removed_after_the_leak_check() -> Iterator[list[Path]]:
    """Segments removed only once the module is done: after every test's own leak check ran."""
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)


def test_a_segment_of_another_job_is_not_blamed(removed_after_the_leak_check: list[Path]) -> None:
    # Another timeshare run on this machine: its own runtime directory, its own live process.
    # The segment outlives this test, so the autouse check sees it and must not fail the test.
    other_job = staging_tag(Path("/run/someone-else/timeshare"))
    for tag in (other_job, "tcp"):
        name = segment_name(tag, FOREIGN_PID, session=0x51)
        removed_after_the_leak_check.append(make_segment(name))
        assert name in staging_segments()


def test_a_segment_tagged_with_the_tests_runtime_dir_is_reported(runtime_dir: Path) -> None:
    run = runtime_dir / "run"  # endpoints sit in subdirectories too
    run.mkdir()
    ours = segment_name(staging_tag(run), FOREIGN_PID, session=1)  # owner need not be ours
    theirs = segment_name(staging_tag(Path("/run/someone-else")), FOREIGN_PID, session=2)
    tags = directory_tags([runtime_dir])
    assert segments_of_this_test({ours, theirs}, tags=tags, processes=set()) == {ours}


def test_a_segment_owned_by_the_test_run_is_reported_whatever_its_tag() -> None:
    mine = segment_name("tcp", os.getpid(), session=3)
    foreign = segment_name("tcp", FOREIGN_PID, session=4)
    found = segments_of_this_test({mine, foreign}, tags=set(), processes=own_processes())
    assert found == {mine}


def test_a_leak_in_a_runtime_dir_fails_the_check(runtime_dir: Path) -> None:
    # The real path, end to end but for the verdict: a segment left in /dev/shm with this
    # test's tag is found among the new segments (then removed, so that this test passes).
    before = staging_segments()
    path = make_segment(segment_name(staging_tag(runtime_dir), FOREIGN_PID, session=5))
    try:
        new = staging_segments() - before
        assert segments_of_this_test(
            new, tags=directory_tags([runtime_dir]), processes=own_processes()
        ) == {path.name}
    finally:
        path.unlink()
