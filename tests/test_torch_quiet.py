"""torch's C++ warnings stay off the fronts' stderr (a store gone prints a stack trace per call
otherwise), and the workers get the user's own level back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from timeshare import torch_quiet
from timeshare.cycle.workers import worker_environment

ROOT = Path(__file__).resolve().parents[1]
# A client of a store whose host died: the next call fails, as a follower's beat does when
# the leader is gone.
STORE_GONE = """
import subprocess, sys, time
{first}
from timeshare.errors import StoreError
from timeshare.protocols.store import JobStore
host = subprocess.Popen([sys.executable, "-c", "from timeshare.protocols.store import JobStore;"
    "import time; s = JobStore.host(); print(s.address[1], flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True)
client = JobStore.connect("127.0.0.1", int(host.stdout.readline()), timeout_s=10)
client.put("k", 1)
host.kill(); host.wait()
time.sleep(0.2)
try:
    client.put("k", 2); client.has("k")
except StoreError as exc:
    print("StoreError:", exc)
"""


def store_gone(first: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    script = STORE_GONE.format(first=first)
    return subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_front_says_a_store_is_gone_in_one_line_not_a_stack_trace() -> None:
    plain = store_gone("")
    assert "StoreError: job store at" in plain.stdout, plain.stderr
    assert "Exception raised from" in plain.stderr  # what torch prints, untouched
    front = store_gone("import timeshare.daemon")
    assert "StoreError: job store at" in front.stdout, front.stderr
    assert "Exception raised from" not in front.stderr and "frame #" not in front.stderr


@pytest.mark.parametrize(("users", "worker_gets"), [(None, None), ("INFO", "INFO")])
def test_workers_get_the_users_level_back(
    monkeypatch: pytest.MonkeyPatch, users: str | None, worker_gets: str | None
) -> None:
    monkeypatch.setattr(torch_quiet, "_quieted", True)
    monkeypatch.setattr(torch_quiet, "_users", users)
    env = worker_environment({"TORCH_CPP_LOG_LEVEL": "ERROR", "NOTIFY_SOCKET": "/x", "A": "b"})
    assert env.get("TORCH_CPP_LOG_LEVEL") == worker_gets
    assert env.get("A") == "b" and "NOTIFY_SOCKET" not in env
