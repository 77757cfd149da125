"""One expensive run per test session, shared by every pytest-xdist worker whose tests read it.

A module-scoped fixture runs once per worker that runs any of the module's tests: with work
stealing, a module's tests land on several workers, and a ten-step Megatron run was made twice
in one `make test` (about 70 s of CPU each, on a machine whose two cores every test shares).
Here the first worker to need a run makes it, under a lock, in the session's shared directory;
the others wait on the lock (idle) and read what it left. The session's end removes the
directory (conftest.py). The run's directory must be read only by the tests that share it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

SESSION_MARK = (
    "TESTS_SESSION_MARK"  # (conftest.py sets it: one value for all of a session's workers)
)
LOCK_POLL_S = 0.2


def shared_dir() -> Path:
    """The session's directory of shared runs (a short path: ipc paths are bounded)."""
    return Path(f"/tmp/tss-{os.environ[SESSION_MARK]}")


def shared_run(
    key: str, run: Callable[[Path], subprocess.CompletedProcess[str]], *, timeout_s: float
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The directory `run` made its run in, and how the run ended: made by `run(directory)`
    here if no worker of the session made it yet (one that raised made nothing: the next one
    to ask tries again), else as that worker left it. `timeout_s` bounds the wait for another
    worker's run as well as this one's."""
    base = shared_dir()
    base.mkdir(mode=0o700, exist_ok=True)
    root, record = base / key, base / f"{key}.json"
    with _locked(base / f"{key}.lock", timeout_s):
        if not record.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            done = run(root)
            ended = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            record.write_text(json.dumps({"args": [str(a) for a in done.args], **ended}))
    ran = json.loads(record.read_text())
    done = subprocess.CompletedProcess(ran["args"], ran["returncode"], ran["stdout"], ran["stderr"])
    return root, done


def remove_shared_runs() -> None:
    shutil.rmtree(shared_dir(), ignore_errors=True)


@contextmanager
def _locked(path: Path, timeout_s: float) -> Iterator[None]:
    with path.open("a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} was held past {timeout_s} s") from None
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
