"""Bad input at a running daemon's control socket, and reload: nothing crashes, nothing stops."""

from __future__ import annotations

import json
import socket
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.daemon.daemons import (
    Daemon,
    assert_daemon_left_nothing,
    running_daemon,
    service_config,
)
from timeshare.errors import ControlError
from timeshare.protocols.control import METHODS, parse_request

pytestmark = pytest.mark.slow

LIMIT = 4096  # [daemon].max_request_bytes in the test config
ERRORS = {"BadRequest", "UnknownMethod", "BadParams", "RequestTooLarge"}
PROBE = b'{"id": "probe", "method": "status"}\n'

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def encoded(value: Any) -> bytes:
    return json.dumps(value).encode()


random_bytes = st.binary(max_size=300).map(lambda b: b.replace(b"\n", b" "))
broken_json = st.builds(
    lambda method, cut: encoded({"id": 1, "method": method})[:cut],
    st.sampled_from(sorted(METHODS)),
    st.integers(1, 25),
)
not_objects = json_values.filter(lambda v: not isinstance(v, dict)).map(encoded)
unknown_methods = st.builds(
    lambda method, request_id: encoded({"id": request_id, "method": method}),
    st.text(max_size=30).filter(lambda m: m not in METHODS),
    st.integers() | st.text(max_size=5),
)
wrong_params = st.builds(
    lambda method, params: encoded({"id": 2, "method": method, "params": params}),
    st.sampled_from(sorted(METHODS)),
    st.dictionaries(
        st.sampled_from(["wait", "timeout_s", "level", "x", ""]), json_values, min_size=1
    ),
)
wrong_envelopes = st.builds(
    encoded,
    st.fixed_dictionaries(
        {"method": json_values.filter(lambda v: not isinstance(v, str))},
        optional={"id": json_values, "params": json_values, "extra": json_values},
    ),
)
oversized = st.builds(
    lambda filler, n: encoded({"id": 3, "method": "status", "params": {"x": filler * n}}),
    st.sampled_from(["a", "é", "0"]),
    st.integers(LIMIT, 4 * LIMIT),
)


def mutating(line: bytes) -> bool:
    """A line that would be a well-formed command that changes the job (never sent here)."""
    try:
        call = parse_request(line)
    except ControlError:
        return False
    return call.method != "status"


def exchange(daemon: Daemon, line: bytes) -> list[dict[str, Any]]:
    """Send `line` and a status probe; every reply until the probe's (or until closed)."""
    replies = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(30)
        client.connect(str(daemon.socket))
        reader = client.makefile("rb")
        # Closed on an oversized line while it was still being sent: the replies tell.
        with suppress(BrokenPipeError, ConnectionResetError):
            client.sendall(line + b"\n" + PROBE)
        while True:
            try:
                raw = reader.readline()
            except ConnectionResetError:
                break
            if not raw:
                break  # the server closed the connection
            reply = json.loads(raw)
            replies.append(reply)
            if reply.get("id") == "probe":
                break
    return replies


def test_random_and_malformed_requests_get_errors_and_the_cycle_goes_on(runtime_dir: Path) -> None:
    with running_daemon(runtime_dir, service_config(runtime_dir)) as daemon:
        before = daemon.wait_for(lambda s: s["lifecycle"] == "running" and (s["step"] or 0) >= 1)

        @settings(
            max_examples=250,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            database=None,
        )
        @given(
            line=random_bytes
            | broken_json
            | not_objects
            | unknown_methods
            | wrong_params
            | wrong_envelopes
            | oversized
        )
        def one_line(line: bytes) -> None:
            assume(not mutating(line))
            replies = exchange(daemon, line)
            probe = [r for r in replies if r.get("id") == "probe"]
            errors = [r for r in replies if r.get("id") != "probe"]
            for reply in errors:
                assert reply["error"]["name"] in ERRORS, reply
                assert reply["error"]["state"] == "running" and reply["error"]["message"]
            if len(line) > LIMIT:
                assert [e["error"]["name"] for e in errors] == ["RequestTooLarge"] and not probe
            else:
                if line.strip() and not _is_valid_status(line):
                    assert len(errors) == 1, replies
                assert probe and probe[0]["result"]["lifecycle"] == "running", replies

        one_line()
        after = daemon.status()
        assert after["pid"] == before["pid"] and after["lifecycle"] == "running"
        assert after["step"] > before["step"]  # the cycle went on throughout
        assert daemon.stop() == 0
    assert_daemon_left_nothing(runtime_dir)


def _is_valid_status(line: bytes) -> bool:
    try:
        return parse_request(line).method == "status"
    except ControlError:
        return False


def test_reload_applies_live_keys_refuses_the_rest_and_survives_a_broken_file(
    runtime_dir: Path,
) -> None:
    config = service_config(runtime_dir)
    original = config.read_text()
    with running_daemon(runtime_dir, config) as daemon:
        daemon.wait_for(lambda s: s["lifecycle"] == "running")

        config.write_text(
            original.replace("phase_s = 30.0", "phase_s = 45.0").replace(
                "steps = 100000", "steps = 90000"
            )
            + '\n[log]\nlevel = "debug"\n'
        )
        applied = daemon.ctl("reload")
        assert applied.returncode == 0, applied.stderr
        for key in ("deadlines.phase_s = 45.0", "job.steps = 90000", "log.level = debug"):
            assert key in applied.stdout
        status = daemon.status()
        assert status["steps"] == 90000 and status["log_level"] == "debug"

        config.write_text(
            original.replace("ranks = 2", "ranks = 3").replace(
                "bucket_mb = 0.25", "bucket_mb = 1.0"
            )
        )
        refused = daemon.ctl("reload")
        assert refused.returncode == 1
        assert "ReloadRefused" in refused.stderr
        assert "job.ranks" in refused.stderr and "transfer.bucket_mb" in refused.stderr
        assert daemon.status()["steps"] == 90000  # the running config stays, all of it

        config.write_text(original + "\n[job\n")
        broken = daemon.ctl("reload")
        assert broken.returncode == 1 and "not valid TOML" in broken.stderr
        config.write_text(original.replace("phase_s = 30.0", "phase_s = 5.0"))
        nested = daemon.ctl("reload")  # the transfer timeouts no longer fit inside a phase
        assert nested.returncode == 1 and "must be shorter than deadlines.phase_s" in nested.stderr
        step = daemon.status()["step"]
        daemon.wait_for(lambda s: s["lifecycle"] == "running" and s["step"] > step)

        # Clients beyond [daemon].max_clients are told so and closed; the others are served.
        held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
        try:
            for client in held:
                client.connect(str(daemon.socket))
            # Until the server has accepted all 8 (each holds a place), a ninth is still served.
            deadline = time.monotonic() + 10
            busy = daemon.call("status")
            while "error" not in busy and time.monotonic() < deadline:
                time.sleep(0.05)
                busy = daemon.call("status")
            assert busy["error"]["name"] == "Busy" and "limit is 8" in busy["error"]["message"]
        finally:
            for client in held:
                client.close()
        deadline = time.monotonic() + 10
        while "error" in daemon.call("status") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.call("status")["result"]["lifecycle"] == "running"

        # A lower step limit takes effect at the next cycle boundary.
        limit = daemon.status()["step"] + 3
        config.write_text(original.replace("steps = 100000", f"steps = {limit}"))
        assert daemon.ctl("reload").returncode == 0
        idle = daemon.wait_for(lambda s: s["lifecycle"] == "idle")
        assert idle["reason"] == f"completed {limit} steps"
        assert daemon.stop() == 0
    assert_daemon_left_nothing(runtime_dir)
