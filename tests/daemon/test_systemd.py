"""systemd: unit files (systemd-analyze), sd_notify on a real datagram socket, socket activation."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import required_tool
from tests.cycle.jobs import processes_of, workers_of
from tests.daemon.daemons import (
    Daemon,
    assert_daemon_left_nothing,
    reap,
    running_daemon,
    service_config,
)
from timeshare.config import DeadlineSection
from timeshare.cycle.workers import SERVICE_VARIABLES
from timeshare.daemon.health import watchdog_fed
from timeshare.daemon.systemd import (
    Notifier,
    listen_sockets,
    take_service_variables,
    watchdog_interval_s,
)
from timeshare.state.service import ServiceLifecycle

UNITS = Path(__file__).parents[2] / "systemd"
UNIT = "timeshared.service"
SECURITY_THRESHOLD = 25  # systemd-analyze's scale is 0..100 (shown /10): "2.5 OK" at most


def installed_units(directory: Path) -> Path:
    """The unit files as installed: their binaries are this environment's."""
    bin_dir = Path(sys.executable).parent
    for unit in ("timeshared.service", "timeshared.socket"):
        text = (UNITS / unit).read_text().replace("/usr/local/bin/", f"{bin_dir}/")
        (directory / unit).write_text(text)
    return directory


def verify(units: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` of the installed units (and drop-ins) in `units`."""
    return subprocess.run(
        [required_tool("systemd-analyze"), "verify", "timeshared.service", "timeshared.socket"],
        cwd=units,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_both_unit_files_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    result = verify(installed_units(tmp_path))
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_the_service_is_hardened_below_the_threshold(tmp_path: Path) -> None:
    units = installed_units(tmp_path)
    result = subprocess.run(
        [
            required_tool("systemd-analyze"),
            "security",
            "--offline=yes",
            f"--threshold={SECURITY_THRESHOLD}",
            UNIT,
        ],
        cwd=units,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "Overall exposure level for timeshared.service" in result.stdout
    service = (UNITS / "timeshared.service").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "KillMode=mixed", "Restart=on-failure"):
        assert f"\n{line}\n" in service
    assert (
        "ExecReload=/usr/local/bin/timesharectl --socket /run/timeshared/control.sock reload\n"
        in service
    )
    # Hardening must not hide the accelerators.
    assert "\nPrivateDevices=yes" not in service and "\nDevicePolicy=closed" not in service


def test_the_threshold_can_fail(tmp_path: Path) -> None:
    units = installed_units(tmp_path)
    result = subprocess.run(
        [required_tool("systemd-analyze"), "security", "--offline=yes", "--threshold=1", UNIT],
        cwd=units,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0


class NotifySocket:
    """A real datagram socket standing in for systemd's notify socket, read as systemd does:
    all the time (a thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.closing = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while not self.closing.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append((time.monotonic(), fields))

    def wait_until(
        self, condition: Callable[[list[dict[str, str]]], bool], timeout: float = 60.0
    ) -> None:
        """Until the messages received so far meet `condition`."""
        deadline = time.monotonic() + timeout
        while not condition([m for _, m in self.messages]):
            assert time.monotonic() < deadline, f"not within {timeout} s: {self.messages[-5:]}"
            time.sleep(0.02)

    def wait_for(self, key: str, seen: int = 0, timeout: float = 60.0) -> dict[str, str]:
        """The first message from index `seen` on that carries `key`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, message in self.messages[seen:]:
                if key in message:
                    return message
            time.sleep(0.02)
        raise AssertionError(f"no {key} within {timeout} s: {self.messages[-5:]}")

    def read_all(self) -> None:
        """Until every datagram queued now has been read: ours, sent last, comes last."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"FLUSHED=1", str(self.path))
        self.wait_until(lambda m: any("FLUSHED" in x for x in m))

    def close(self) -> None:
        self.closing.set()
        self.reader.join(timeout=5)
        self.sock.close()
        self.path.unlink(missing_ok=True)


def statuses(messages: list[dict[str, str]]) -> list[str]:
    return [m["STATUS"] for m in messages if "STATUS" in m]


def pings(notify: NotifySocket) -> list[float]:
    """When each WATCHDOG=1 arrived."""
    return [t for t, m in notify.messages if m.get("WATCHDOG") == "1"]


def worker_environments(daemon: Daemon) -> list[dict[str, str]]:
    environments = []
    for process in workers_of(daemon.root):
        raw = Path(f"/proc/{process.pid}/environ").read_bytes()
        environments.append(
            dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)
        )
    return environments


@pytest.mark.slow
def test_notifications_on_a_real_notify_socket(runtime_dir: Path) -> None:
    notify = NotifySocket(runtime_dir / "notify.sock")
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    try:
        with running_daemon(runtime_dir, service_config(runtime_dir), env) as daemon:
            ready = notify.wait_for("READY")
            assert ready["READY"] == "1" and ready["STATUS"].startswith("running")
            sent = [m for _, m in notify.messages]
            startup = sent[: sent.index(ready)]
            assert any(int(m.get("EXTEND_TIMEOUT_USEC", 0)) > 0 for m in startup)
            daemon.wait_for(lambda s: (s["step"] or 0) >= 3)
            # The workers never see systemd's variables.
            environments = worker_environments(daemon)
            assert len(environments) == 4
            assert all(not set(SERVICE_VARIABLES) & set(e) for e in environments)

            # STATUS= on every phase, and WATCHDOG=1 at half the interval (0.5 s): two pings.
            phases = ("train", "offload", "sync", "barrier", "resume", "rollout")
            notify.wait_until(lambda m: all(any(p in s for s in statuses(m)) for p in phases))
            notify.wait_until(lambda m: len(pings(notify)) >= 2)
            assert min(b - a for a, b in itertools.pairwise(pings(notify))) > 0.3

            before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            seen = len(notify.messages)
            daemon.process.send_signal(signal.SIGHUP)  # reload
            reloading = notify.wait_for("RELOADING", seen)
            after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            assert before <= int(reloading["MONOTONIC_USEC"]) <= after
            assert notify.wait_for("READY", seen)["READY"] == "1"  # reloaded

            assert daemon.stop() == 0
        notify.read_all()  # the daemon has exited: everything it sent is queued
        sent = [m for _, m in notify.messages]
        stopping = [m for m in sent if "STOPPING" in m]
        assert len(stopping) == 1 and stopping[0]["STOPPING"] == "1"
        after_stop = sent[sent.index(stopping[0]) :]
        assert any("EXTEND_TIMEOUT_USEC" in m for m in after_stop)  # the drain is extended
        assert sum(1 for _, m in notify.messages if m.get("READY") == "1") == 2  # start, reload
    finally:
        notify.close()
    assert_daemon_left_nothing(runtime_dir)


@pytest.mark.slow
def test_socket_activation_starts_the_daemon_idle(runtime_dir: Path) -> None:
    config = service_config(runtime_dir)
    path = runtime_dir / "activated.sock"
    argv = [required_tool("systemd-socket-activate"), "-l", str(path), "--fdname=control"]
    activator = subprocess.Popen(
        [*argv, sys.executable, "-m", "timeshare.daemon", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    daemon = Daemon(runtime_dir, config, activator, path, runtime_dir / "none.log")
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline and activator.poll() is None
            time.sleep(0.05)
        status = daemon.status()  # this connection starts timeshared
        assert status["lifecycle"] == "idle" and "socket-activated" in status["reason"]
        # Workers are spawned only by a cycle, and a cycle starts only from STARTING, which an
        # activated service reaches by `resume` alone: none can exist now, nor appear later.
        assert [p.pid for p in processes_of(runtime_dir)] == [activator.pid]  # no worker
        assert daemon.call("resume")["result"]["lifecycle"] == "starting"
        # A pause sent while the cycle is still starting reaches it (it is not lost to a cycle
        # that reads the job store's commands only once it runs).
        paused = daemon.call("pause", wait=True, timeout_s=60)
        assert paused["result"]["lifecycle"] == "paused", paused
        assert daemon.call("resume")["result"]["lifecycle"] in ("paused", "running")
        daemon.wait_for(lambda s: s["lifecycle"] == "running" and (s["step"] or 0) >= 1)
        assert all(not set(SERVICE_VARIABLES) & set(e) for e in worker_environments(daemon))
        assert daemon.call("stop")["result"]["lifecycle"] == "stopping"
        assert activator.wait(timeout=60) == 0
    finally:
        reap(daemon)
    assert not (runtime_dir / "run" / "control.sock").exists()  # it used the passed socket
    assert_daemon_left_nothing(runtime_dir)


# -- the protocol pieces, in-process ----------------------------------------------------------


def test_notifier_sends_datagrams_to_an_abstract_socket() -> None:
    name = f"timeshare-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name)
        receiver.settimeout(5)
        notifier = Notifier.from_environment({"NOTIFY_SOCKET": "@" + name})
        notifier.ready("running step 1")
        notifier.stopping("bye")
        notifier.stopping("again")
        notifier.close()
        assert receiver.recv(4096) == b"READY=1\nSTATUS=running step 1"
        assert receiver.recv(4096) == b"STOPPING=1\nSTATUS=bye"
        receiver.settimeout(0.2)
        with pytest.raises(TimeoutError):
            receiver.recv(4096)  # STOPPING=1 once


def test_without_systemd_nothing_is_sent_and_nothing_fails() -> None:
    notifier = Notifier.from_environment({})
    notifier.watchdog()
    assert notifier.address is None and notifier.sent == ["WATCHDOG=1"]


def test_watchdog_interval_is_half_and_only_for_this_process() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None
    mine = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval_s(mine) == 2.0
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None


def test_listen_fds_for_another_process_are_ignored() -> None:
    assert listen_sockets({"LISTEN_FDS": "1", "LISTEN_PID": "1"}) == {}
    environ = {"LISTEN_FDS": "1", "LISTEN_PID": "1", "NOTIFY_SOCKET": "/x", "PATH": "/bin"}
    taken = take_service_variables(environ)
    assert environ == {"PATH": "/bin"} and set(taken) == {
        "LISTEN_FDS",
        "LISTEN_PID",
        "NOTIFY_SOCKET",
    }


def test_the_watchdog_is_fed_only_while_a_running_cycle_moves() -> None:
    deadlines = DeadlineSection()
    stuck_s = max(deadlines.phase_s, deadlines.ready_s) + deadlines.stall_s
    running = ServiceLifecycle.RUNNING
    assert watchdog_fed(running, cycle_runs=False, since_progress_s=stuck_s, deadlines=deadlines)
    assert watchdog_fed(running, cycle_runs=True, since_progress_s=1.0, deadlines=deadlines)
    # No transition for longer than any deadline allows: stuck, let systemd restart it.
    assert not watchdog_fed(running, cycle_runs=True, since_progress_s=stuck_s, deadlines=deadlines)
    for state in (ServiceLifecycle.STARTING, ServiceLifecycle.DRAINING, ServiceLifecycle.STOPPING):
        assert not watchdog_fed(
            state, cycle_runs=True, since_progress_s=stuck_s, deadlines=deadlines
        )
    # Paused for an hour on purpose, or idle: nothing is supposed to move.
    for state in (ServiceLifecycle.PAUSED, ServiceLifecycle.IDLE):
        assert watchdog_fed(state, cycle_runs=True, since_progress_s=3600.0, deadlines=deadlines)
