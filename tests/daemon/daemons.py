"""A real `timeshared` subprocess for tests, driven through its socket and `timesharectl`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.configs import SERVICE, toml_file
from tests.cycle.jobs import processes_of
from timeshare.cycle.workers import prepare_runtime


def service_config(
    root: Path, *, steps: int = 100_000, rollout_s: float = 0.02, **sections: Any
) -> Path:
    """A daemon's job with simulated engines (rollouts of `rollout_s` on both ranks)."""
    delays = {"rollout": {"0": rollout_s, "1": rollout_s}}
    return toml_file(
        root,
        SERVICE,
        "timeshared.toml",
        job={"steps": steps},
        engine={"simulated": {"delays": delays}},
        **sections,
    )


@dataclass
class Daemon:
    root: Path
    config: Path
    process: subprocess.Popen[bytes]
    socket: Path
    log: Path

    def ctl(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "timeshare.daemon.ctl", "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def call(self, method: str, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        """One request on a fresh connection; the whole reply (result or error)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(timeout)
            client.connect(str(self.socket))
            request = {"id": 7, "method": method, "params": params}
            # A server over its client limit answers Busy and closes at once, maybe before the
            # request went out (EPIPE): its answer is still there to read.
            with contextlib.suppress(BrokenPipeError):
                client.sendall(json.dumps(request).encode() + b"\n")
            reply: dict[str, Any] = json.loads(client.makefile("rb").readline())
            return reply

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("status")["result"]
        return result

    def wait_for(
        self, condition: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status = self.status()
        while not condition(status):
            assert self.process.poll() is None, f"the daemon exited: {self.log_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not reached in {timeout} s: {status}"
            time.sleep(0.05)
            status = self.status()
        return status

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_text().splitlines():
            with suppress(json.JSONDecodeError):
                events.append(json.loads(line))
        return events

    def wait_until_logged(self, event: str, count: int = 1, timeout: float = 60.0) -> None:
        """Until the log holds `count` lines naming `event` (the daemon's JSON lines, or its
        workers' console lines: a worker writes to the daemon's stderr)."""
        deadline = time.monotonic() + timeout
        while self.log_text().count(event) < count:
            assert time.monotonic() < deadline, f"{event} x{count} not logged in {timeout} s"
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


def spawn_daemon(root: Path, config: Path, env: dict[str, str] | None = None) -> Daemon:
    """Start `python -m timeshare.daemon` and wait until its control socket answers."""
    log = root / f"daemon-{time.monotonic_ns()}.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "timeshare.daemon", "--config", str(config)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    daemon = Daemon(root, config, process, root / "run" / "control.sock", log)
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, (
            f"timeshared exited {process.returncode}: {daemon.log_text()}"
        )
        try:
            daemon.status()
            return daemon
        except OSError:
            assert time.monotonic() < deadline, "the control socket never answered"
            time.sleep(0.05)


@contextmanager
def running_daemon(root: Path, config: Path, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    daemon = spawn_daemon(root, config, env)
    try:
        yield daemon
    finally:
        reap(daemon)


def reap(daemon: Daemon) -> None:
    """However a test ended: the daemon gone, and whatever it left reaped."""
    if daemon.process.poll() is None:
        daemon.process.send_signal(signal.SIGTERM)
        try:
            daemon.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait(timeout=10)
    prepare_runtime(daemon.root / "run" / "job")


def assert_daemon_left_nothing(root: Path) -> None:
    """No process of the job, no socket file, no record of workers (staging: the autouse check)."""
    deadline = time.monotonic() + 10
    while processes_of(root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_of(root) == []
    run = root / "run"
    left = [p for p in run.rglob("*")] if run.exists() else []
    assert [p for p in left if p.is_socket() or p.name == "workers.json"] == [], left
