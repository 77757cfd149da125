"""Fixtures shared by every test: short runtime directories and a leak check around each test.

The leak check blames a test only for staging segments that are its own, so that another
timeshare run on the same machine (someone else's job, a benchmark) cannot fail it: a segment
is the test's when its tag is that of a directory the test used, or when its owner is this
process or one of its live descendants (segments.py says how a name carries both).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil
import pytest
import structlog

from tests.shared_runs import SESSION_MARK, remove_shared_runs
from timeshare.protocols.weights.segments import SEGMENT_PREFIX, parse_segment_name, staging_tag
from timeshare.runtime import SHM_ROOT, process_start_time

# torch's TCPStore resolves the peer's address back to a name on every connection (client and
# server side, for its log lines). On a machine whose DNS server drops a query now and then,
# glibc waits 5 s before it asks again: one job-store connection in a few dozen stalls 5 s.
# Every process of a test inherits this: a dropped query then costs 1 s.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")

# Tests read logs from stderr only; stdout of peer processes carries their JSON events.
structlog.configure(logger_factory=structlog.PrintLoggerFactory(__import__("sys").stderr))

# Fixtures holding the directories a test works in (their tags name its segments).
DIRECTORY_FIXTURES = ("runtime_dir", "tmp_path")

# Every process the session starts carries this mark in its environment (children inherit it;
# pytest-xdist's workers keep their controller's): one still running when the session ends, not
# a descendant of the session's own process, was left behind by the test its
# PYTEST_CURRENT_TEST names. (One spinning child, left so, took half a core of this two-core
# machine for the rest of `make test`.)
# For processes a last test ended a moment ago to be gone (tests/test_left_behind.py, which
# leaks one on purpose, waits less).
LEFT_BEHIND_S = float(os.environ.get("TESTS_LEFT_BEHIND_S", "10"))


def staging_segments(runtime_dir: Path | None = None) -> set[str]:
    """Names of the staging segments in /dev/shm: all of them, or those of `runtime_dir`."""
    names = {p.name for p in SHM_ROOT.glob(f"{SEGMENT_PREFIX}*")}
    if runtime_dir is None:
        return names
    tag = staging_tag(runtime_dir)
    return {n for n in names if (parsed := parse_segment_name(n)) and parsed.tag == tag}


def socket_files(directory: Path) -> list[Path]:
    if not directory.exists():
        return []
    return [p for p in directory.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]


def required_tool(tool: str) -> str:
    """The full path of a tool a test runs. A missing one fails the test, naming the tool: tests
    never skip for a missing tool (`make test` installs them, see the Makefile's test-tools)."""
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed (`make test-tools` installs it)")
    return path


def directory_tags(roots: Iterable[Path]) -> set[str]:
    """The staging tag of each directory under `roots`, the roots included."""
    tags: set[str] = set()
    for root in roots:
        tags.add(staging_tag(root))  # even if the test removed it
        # os.walk skips what vanishes while it walks (a worker still exiting may remove its own).
        tags.update(staging_tag(Path(directory)) for directory, _, _ in os.walk(root))
    return tags


def own_processes() -> set[tuple[int, int]]:
    """(pid, start time) of this process and of each of its live descendants."""
    pids = [psutil.Process().pid, *(p.pid for p in psutil.Process().children(recursive=True))]
    return {(pid, start) for pid in pids if (start := process_start_time(pid)) is not None}


def segments_of_this_test(
    names: Iterable[str], *, tags: set[str], processes: set[tuple[int, int]]
) -> set[str]:
    """Which of `names` the test made: tagged with one of `tags` (its directories), or owned by
    one of `processes` (this process tree). A "tcp" segment has no directory: only its owner
    can make it the test's."""
    own = set()
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is None:
            continue  # not a name timeshare gives (segments.segment_names)
        if parsed.tag in tags or (parsed.pid, parsed.start) in processes:
            own.add(name)
    return own


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A private runtime directory with a short path (ipc paths are limited to 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    directory.chmod(0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaked_staging(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test must remove the staging segments it made; others' segments are not its own."""
    # Requested here, so that they are torn down after this check: the tags of the test's
    # directories are read while those directories still exist.
    directories = [
        request.getfixturevalue(name) for name in DIRECTORY_FIXTURES if name in request.fixturenames
    ]
    before = staging_segments()
    yield
    new = staging_segments() - before
    leaked = segments_of_this_test(new, tags=directory_tags(directories), processes=own_processes())
    assert not leaked, f"staging segments left in /dev/shm: {sorted(leaked)}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slow` (real engines, real daemons) run first, the daemons' first of all,
    so that with several pytest workers (`make test`) the longest are not left for last. Tests
    marked `gpu` need a CUDA device; without one they are skipped, saying so."""
    import torch

    def longest_first(item: pytest.Item) -> tuple[bool, bool]:
        return "slow" not in item.keywords, not item.nodeid.startswith("tests/daemon/")

    items.sort(key=longest_first)  # stable: within a group, files stay in order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(SESSION_MARK, f"{os.getpid()}-{os.urandom(4).hex()}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session fails if a process it started outlives it; those are killed, each named
    with the test that started it."""
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller looks, once every worker is gone
    remove_shared_runs()
    mark = os.environ[SESSION_MARK]
    deadline = time.monotonic() + LEFT_BEHIND_S
    while (left := left_behind(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "processes left behind by tests")
    for process, test in left.items():
        with contextlib.suppress(psutil.Error):
            process.kill()
        if reporter is not None:
            reporter.write_line(
                f"a process outlived its test, killed: pid {process.pid} "
                f"{' '.join(process.info['cmdline'] or [])[:120]!r}, started by {test}"
            )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def left_behind(mark: str) -> dict[psutil.Process, str]:
    """Processes carrying `mark` that are neither this one nor its descendants: each with the
    test that started it (its PYTEST_CURRENT_TEST)."""
    own = {psutil.Process().pid, *(p.pid for p in psutil.Process().children(recursive=True))}
    left = {}
    for process in psutil.process_iter(["cmdline"]):
        if process.pid in own:
            continue
        try:
            environ = process.environ()
        except psutil.Error:  # gone, a zombie, or not ours to read
            continue
        if environ.get(SESSION_MARK) == mark:
            left[process] = environ.get("PYTEST_CURRENT_TEST", "no test (the session itself)")
    return left
