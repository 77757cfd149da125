"""The session's own check (conftest.py `pytest_sessionfinish`): a process a test leaves behind
fails the session, named with its test, and is killed; with pytest-xdist's workers too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
# A test whose child forks a grandchild and exits: the grandchild, an orphan, sleeps on.
LEAKS = """
import subprocess, sys

def test_leaks_an_orphan():
    code = "import os, time\\nif os.fork(): os._exit(0)\\ntime.sleep(300)  # TOKEN"
    subprocess.run([sys.executable, "-c", code], check=True)

def test_leaks_nothing():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_a_process_left_behind_fails_the_session_naming_its_test(
    tmp_path: Path, workers: list[str]
) -> None:
    token = f"left-behind-{tmp_path.name}"
    (tmp_path / "test_leaks.py").write_text(LEAKS.replace("TOKEN", token))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            *workers,
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_leaks.py"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_environ(), "TESTS_LEFT_BEHIND_S": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert "processes left behind by tests" in done.stdout
    assert "started by test_leaks.py::test_leaks_an_orphan (call)" in done.stdout
    assert "test_leaks_nothing" not in done.stdout.split("processes left behind")[1]
    deadline = time.monotonic() + 10
    while _running(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(token), "the process left behind was not killed"


def _environ() -> dict[str, str]:
    """This session's environment less its mark and pytest's variables (a pytest-xdist
    worker's among them): the inner session is a session of its own."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != "TESTS_SESSION_MARK" and not k.startswith("PYTEST_")
    }


def _running(token: str) -> bool:
    return any(
        process.info["status"] != psutil.STATUS_ZOMBIE
        and token in " ".join(process.info["cmdline"] or [])
        for process in psutil.process_iter(["cmdline", "status"])
    )
