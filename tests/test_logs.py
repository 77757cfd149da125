"""Logging as a service writes it: JSON or console, journal priorities, contextvars, stdlib."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, structlog
from timeshare import logs
logs.configure("info", service=True)
structlog.contextvars.bind_contextvars(step=3, phase="sync", rank=1, engine="torch_ref")
log = structlog.get_logger("t")
log.info("sync.bucket.acked", bucket=2)
log.warning("sync.slow")
logging.getLogger("zmq").error("from the stdlib")
logs.set_level("warning")
log.info("hidden")
logging.getLogger("torch").info("hidden too")
log.error("shown")
"""


def run_logging(stderr: int, env: dict[str, str] | None = None) -> None:
    subprocess.run(
        [sys.executable, "-c", SCRIPT],
        stderr=stderr,
        env={**os.environ, **(env or {})},
        timeout=60,
        check=True,
    )


def test_json_lines_off_a_terminal_with_contextvars_and_the_stdlib(tmp_path: Path) -> None:
    out = tmp_path / "stderr"
    with open(out, "wb") as sink:
        run_logging(sink.fileno(), {"JOURNAL_STREAM": ""})
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["event"] for e in events] == [
        "sync.bucket.acked",
        "sync.slow",
        "from the stdlib",
        "shown",
    ]
    first = events[0]
    assert (first["step"], first["phase"], first["rank"], first["engine"]) == (
        3,
        "sync",
        1,
        "torch_ref",
    )
    stdlib = events[2]
    assert stdlib["level"] == "error" and stdlib["pid"] == first["pid"] and "timestamp" in stdlib
    assert stdlib["step"] == 3  # the same processors: contextvars too


def test_priority_prefix_when_stderr_is_the_journal(tmp_path: Path) -> None:
    out = tmp_path / "stderr"
    with open(out, "wb") as sink:
        status = os.fstat(sink.fileno())
        run_logging(sink.fileno(), {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"})
    lines = out.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<6>", "<4>", "<3>", "<3>"]
    assert json.loads(lines[0][3:])["event"] == "sync.bucket.acked"


def test_a_journal_stream_of_another_file_adds_no_prefix(tmp_path: Path) -> None:
    out = tmp_path / "stderr"
    with open(out, "wb") as sink:
        run_logging(sink.fileno(), {"JOURNAL_STREAM": "1:2"})
    assert all(line.startswith("{") for line in out.read_text().splitlines())


def test_console_lines_on_a_terminal() -> None:
    main, child = pty.openpty()
    try:
        run_logging(child, {"JOURNAL_STREAM": ""})
        os.close(child)
        child = -1
        text = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            text += chunk
    finally:
        if child >= 0:
            os.close(child)
        os.close(main)
    lines = text.decode().splitlines()
    assert len(lines) == 4 and not lines[0].startswith("{")
    assert "sync.bucket.acked" in lines[0] and "bucket=2" in lines[0] and "step=3" in lines[0]


def test_every_value_an_event_carries_reaches_the_file_as_json(tmp_path: Path) -> None:
    """msgspec writes the lines: what it has no JSON for is written as its repr (a value, as
    json.dumps' fallback did, and a key: json.dumps wrote True and None keys as true and null),
    so that no event is lost to its encoding."""
    path = tmp_path / "log.jsonl"
    script = f"""
from pathlib import Path
import structlog
from timeshare import logs
logs.configure("info", {str(path)!r})
log = structlog.get_logger("test")
log.info("figures", path=Path("/x"), big=2**70, nan=float("nan"), spans=(("a", 1.5),))
log.info("keys", by_rank={{0: "a", 1: "b"}}, by_flag={{True: "on", None: "unset"}})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["path"] == repr(Path("/x")) and lines[0]["big"] == 2**70
    assert lines[0]["nan"] is None and lines[0]["spans"] == [["a", 1.5]]
    assert lines[1]["by_rank"] == {"0": "a", "1": "b"}
    assert lines[1]["by_flag"] == {"True": "on", "None": "unset"}  # keys too: their repr
