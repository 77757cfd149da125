"""`timeshared` as a real subprocess (simulated engines), operated with `timesharectl`."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import required_tool
from tests.daemon.daemons import (
    assert_daemon_left_nothing,
    running_daemon,
    service_config,
)
from tests.report.trace_format import check_events, check_timeline, load_trace
from timeshare.daemon.records import read_journal, read_progress

pytestmark = pytest.mark.slow
CTL = [sys.executable, "-m", "timeshare.daemon.ctl"]


def test_operate_the_daemon_with_timesharectl(runtime_dir: Path) -> None:
    log = {"tensorboard": f"{runtime_dir}/tensorboard", "trace": f"{runtime_dir}/trace.json"}
    config = service_config(runtime_dir, log=log)
    with running_daemon(runtime_dir, config) as daemon:
        # The socket: 0660 in a 0750 directory.
        assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
        assert stat.S_IMODE(daemon.socket.parent.stat().st_mode) == 0o750
        daemon.wait_for(lambda s: s["lifecycle"] == "running" and (s["step"] or 0) >= 2)
        second = subprocess.run(  # one daemon per socket
            [sys.executable, "-m", "timeshare.daemon", "--config", str(daemon.config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode == 2 and "another process listens on" in second.stderr

        table = daemon.ctl("status")
        assert table.returncode == 0, table.stderr
        for row in ("lifecycle", "committed step", "weight version", "phases", "uptime", "sync"):
            assert row in table.stdout
        as_json = json.loads(daemon.ctl("status", "--json").stdout)
        assert as_json["lifecycle"] == "running" and as_json["weight_version"] >= 1
        assert set(as_json["last_step"]["phases"]) >= {"sync", "barrier", "resume", "rollout"}

        paused = daemon.ctl("pause", "--wait")
        assert paused.returncode == 0, paused.stderr
        status = daemon.status()
        assert status["lifecycle"] == "paused"
        assert set(status["phases"]) == {"rollout"}  # at the cycle boundary: engines asleep
        assert any(e.get("event") == "cycle.pause.verified" for e in daemon.events())
        again = daemon.ctl("pause", "--wait")  # repeating is harmless
        assert again.returncode == 0 and daemon.status()["step"] == status["step"]

        # A log level goes through the job store to every worker's control lane, answered
        # while paused: once all four said so, the cycle has handled a later command, and
        # still nothing moved.
        assert "sync.transfer.finalized" not in daemon.log_text()  # a trainer's debug event
        level = daemon.ctl("log-level", "debug")
        assert level.returncode == 0 and daemon.status()["log_level"] == "debug"
        daemon.wait_until_logged("worker.log_level.set", count=4)
        assert daemon.status()["step"] == status["step"]  # a paused job does not move
        assert daemon.status()["lifecycle"] == "paused"

        assert daemon.ctl("resume").returncode == 0
        daemon.wait_for(lambda s: s["lifecycle"] == "running" and s["step"] > status["step"])
        assert daemon.ctl("resume").returncode == 0  # resuming a running job changes nothing
        step = daemon.status()["step"]
        daemon.wait_for(lambda s: s["step"] >= step + 2)
        assert "sync.transfer.finalized" in daemon.log_text()  # the workers' level changed too

        # One summary line per step, with its figures.
        done = [e for e in daemon.events() if e.get("event") == "cycle.step.done"]
        assert len(done) >= 2 and {"sync_gbps", "rollout_s", "weight_version"} <= set(done[-1])
        # Every command is logged with the caller's uid and pid (SO_PEERCRED).
        received = [e for e in daemon.events() if e.get("event") == "control.request.received"]
        assert {e["method"] for e in received} >= {"status", "pause", "resume", "set_log_level"}
        assert all(e["peer_uid"] == os.getuid() and e["peer_pid"] > 0 for e in received)

        drained = daemon.ctl("drain", "--wait")
        assert drained.returncode == 0, drained.stderr
        idle = daemon.status()
        assert idle["lifecycle"] == "idle" and idle["phases"] == []
        refused = daemon.ctl("pause")
        assert refused.returncode == 1
        assert "NotRunning" in refused.stderr and "state: idle" in refused.stderr
        assert daemon.ctl("drain").returncode == 0  # draining an idle daemon: nothing to do

        stopped = daemon.ctl("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert daemon.process.wait(timeout=60) == 0
    assert not daemon.socket.exists()
    assert_daemon_left_nothing(runtime_dir)
    journal = read_journal(runtime_dir / "state")
    assert {"transition", "command", "service.stop"} <= {e["kind"] for e in journal}
    # [log].tensorboard: a point for every step the service finished, read back by TensorBoard.
    done = sorted(e["step"] for e in journal if e["kind"] == "step.done")
    accumulator = EventAccumulator(str(runtime_dir / "tensorboard"))
    accumulator.Reload()
    assert sorted(e.step for e in accumulator.Scalars("phase_s/sync")) == done and done
    # [log].trace: the cycle's timeline, closed whole as the daemon stopped, the operator's
    # commands and what they did on the driver's track.
    events = load_trace(runtime_dir / "trace.json")
    check_events(events)
    check_timeline(events)
    marks = [e["name"] for e in events if e["ph"] == "i"]
    at_pause = marks.index("paused")
    assert marks.index("command pause") < at_pause < marks.index("command resume", at_pause)
    at_drain = marks.index("draining")
    assert marks.index("command drain") < at_drain < marks.index("stopped", at_drain)
    steps = {e["args"]["step"] for e in events if e["ph"] == "X" and e["cat"] == "phase"}
    assert set(done) <= steps


def test_watch_streams_transitions_and_metrics_scrape(runtime_dir: Path) -> None:
    with running_daemon(runtime_dir, service_config(runtime_dir)) as daemon:
        watch = subprocess.Popen(
            [*CTL, "--socket", str(daemon.socket), "watch", "--json"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert watch.stdout is not None
            lines = [json.loads(watch.stdout.readline()) for _ in range(20)]
        finally:
            watch.kill()
            watch.wait(timeout=10)
        assert lines[0]["kind"] == "status"
        transitions = [e for e in lines if e["kind"] == "transition"]
        assert len(transitions) >= 10
        assert {p for e in transitions for p in e["phases"]} >= {"train", "sync", "rollout"}

        port = daemon.wait_for(lambda s: (s["step"] or 0) >= 2)["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        durations = families["timeshare_phase_duration_seconds"]
        phases = {s.labels["phase"] for s in durations.samples if s.name.endswith("_count")}
        assert phases == {"train", "offload", "sync", "barrier", "resume", "rollout"}
        states = {
            s.labels["timeshare_lifecycle"]: s.value
            for s in families["timeshare_lifecycle"].samples
        }
        assert states["running"] == 1.0 and sum(states.values()) == 1.0
        assert next(iter(families["timeshare_sync_bytes"].samples)).value > 0
        assert next(iter(families["timeshare_sync_gbps"].samples)).value > 0
        acks = {s.name: s.value for s in families["timeshare_sync_ack_seconds"].samples}
        assert acks["timeshare_sync_ack_seconds_count"] >= 2  # one per bucket of every SYNC
        assert 0 < acks["timeshare_sync_ack_seconds_sum"] < 60
        assert "timeshare_committed_step" in families and "timeshare_weight_version" in families
        assert "timeshare_failures" in families and "timeshare_timeouts" in families
        build = next(iter(families["timeshare_build_info"].samples))
        assert build.labels["version"]
        # Every sample says which node of the job it was measured on (one node: node 0).
        assert {s.labels.get("node") for f in families.values() for s in f.samples} == {"0"}
        requests = families["timeshare_control_requests"].samples
        assert any(s.labels.get("method") == "status" and s.value >= 1 for s in requests)
        assert daemon.stop() == 0
    assert_daemon_left_nothing(runtime_dir)


def test_plain_socat_is_a_client(runtime_dir: Path) -> None:
    with running_daemon(runtime_dir, service_config(runtime_dir, steps=2)) as daemon:
        daemon.wait_for(lambda s: s["lifecycle"] == "idle")
        result = subprocess.run(
            [required_tool("socat"), "-", f"UNIX-CONNECT:{daemon.socket}"],
            input='{"id": 1, "method": "status"}\n{"id": 2, "method": "nope"}\n',
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        status, error = (json.loads(line) for line in result.stdout.splitlines())
        assert status["id"] == 1 and status["result"]["lifecycle"] == "idle"
        assert status["result"]["reason"] == "completed 2 steps"
        assert error["error"]["name"] == "UnknownMethod" and error["error"]["state"] == "idle"
        assert daemon.stop() == 0
    assert_daemon_left_nothing(runtime_dir)


def test_while_stopping_pause_and_resume_are_refused_and_stop_is_harmless(
    runtime_dir: Path,
) -> None:
    config = service_config(runtime_dir, rollout_s=2.0)  # a drain that takes a while
    with running_daemon(runtime_dir, config) as daemon:
        daemon.wait_for(lambda s: (s["step"] or 0) >= 1 and "rollout" in s["phases"])
        assert daemon.call("stop")["result"]["lifecycle"] == "stopping"
        for request in ("pause", "resume"):
            error = daemon.call(request)["error"]
            assert error["name"] == "InvalidTransition" and error["state"] == "stopping"
            assert request in error["message"]
        assert daemon.call("stop")["result"]["lifecycle"] == "stopping"  # again: harmless
        assert daemon.process.wait(timeout=60) == 0
    stops = [e for e in read_journal(runtime_dir / "state") if e["kind"] == "service.stop"]
    assert len(stops) == 1
    assert_daemon_left_nothing(runtime_dir)


def test_sigterm_drains_writes_progress_and_exits_0(runtime_dir: Path) -> None:
    with running_daemon(runtime_dir, service_config(runtime_dir)) as daemon:
        daemon.wait_for(lambda s: s["lifecycle"] == "running" and (s["step"] or 0) >= 3)
        started = time.monotonic()
        assert daemon.stop() == 0
        assert time.monotonic() - started < 60  # [daemon].drain_s
    journal = read_journal(runtime_dir / "state")
    transitions = [e for e in journal if e["kind"] == "transition"]
    assert transitions[-1]["lifecycle"] == "stopped"
    assert transitions[-1]["reason"] == "stop requested"
    assert [e["why"] for e in journal if e["kind"] == "service.stop"] == ["SIGTERM"]
    progress = read_progress(runtime_dir / "state")
    assert progress["weight_version"] >= 2 and progress["last_step"]["step"] >= 2
    assert set(progress["last_step"]["phases"]) == {
        "train",
        "offload",
        "sync",
        "barrier",
        "resume",
        "rollout",
    }
    assert_daemon_left_nothing(runtime_dir)


def test_a_failed_cycle_exits_1_for_systemd_to_restart(runtime_dir: Path) -> None:
    kill = {"role": "rollout", "rank": 1, "phase": "rollout", "kind": "kill", "step": 2}
    with running_daemon(runtime_dir, service_config(runtime_dir, faults=[kill])) as daemon:
        assert daemon.process.wait(timeout=60) == 1
    failed = [e for e in read_journal(runtime_dir / "state") if e["kind"] == "cycle.failed"]
    assert len(failed) == 1
    assert (failed[0]["role"], failed[0]["rank"], failed[0]["phase"]) == ("rollout", 1, "rollout")
    assert failed[0]["error_kind"] == "WorkerDied"
    assert any(e.get("event") == "service.cycle.failed" for e in daemon.events())
    assert_daemon_left_nothing(runtime_dir)


def test_a_metrics_port_in_use_is_exit_2_naming_it(runtime_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = service_config(runtime_dir)
        config.write_text(config.read_text().replace("metrics_port = 0", f"metrics_port = {port}"))
        result = subprocess.run(
            [sys.executable, "-m", "timeshare.daemon", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2
    assert f"daemon.metrics_port {port}" in result.stderr and "in use" in result.stderr
    assert_daemon_left_nothing(runtime_dir)
    assert not (runtime_dir / "run" / "control.sock").exists()
