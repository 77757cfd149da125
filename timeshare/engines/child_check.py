"""Ask an engine's own library whether it accepts a config, in a child process.

Importing vLLM or transformers takes seconds and sets process-wide state that a daemon should
not carry, so the checks made at config load (before any worker starts) run as

    python -m <module> '<payload as JSON>'

and the child prints one JSON line last: `{"ok": true}` or `{"ok": false, "error": ...}`.

A check that passed is remembered (CHECKS_DIR), under a key of everything its verdict can
depend on: the module and the payload, the interpreter, every installed distribution's name
and version (their dist-info directories), timeshare's own source files, the files of any
directory the payload names (a model directory: names, sizes, times), the host and the
devices it is shown. The same check asked again is answered at once: each such child costs 5
to 9 s of CPU (vLLM's import, transformers'), at every `timeshare run`. A rejection is never
remembered: it is checked again, and said again, every time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from timeshare.errors import ConfigError

CHECKS_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "timeshare/checks"
KEEP_S = 7 * 24 * 3600.0  # a remembered verdict not renewed within this is removed
# What a check's verdict may read besides its payload: the devices this host shows.
DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def ask_child(module: str, payload: str, what: str, timeout_s: float) -> None:
    """Run `module`'s check (or recall that it passed); a `ConfigError` with its error, or
    saying why it could not answer."""
    passed = CHECKS_DIR / check_key(module, payload)
    if passed.exists():
        with contextlib.suppress(OSError):
            os.utime(passed)  # (asked again: kept, see `_remember`)
        return
    _run_check(module, payload, what, timeout_s)
    with contextlib.suppress(OSError):  # (a cache that cannot be written only costs time)
        _remember(passed)


def check_key(module: str, payload: str) -> str:
    """The key of a check's verdict: equal only where everything it can read is."""
    parts = [module, payload, sys.executable, _environment(), socket.gethostname()]
    parts += [f"{name}={os.environ.get(name, '')}" for name in DEVICE_VARIABLES]
    parts += [_directory_stamp(value) for value in _strings(json.loads(payload))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@functools.cache
def _environment() -> str:
    """Every installed distribution (its dist-info directory names its version) and timeshare's
    own source files (path, size, time): computed once a process."""
    found = sorted(
        entry.name
        for directory in sys.path
        if os.path.isdir(directory)
        for entry in os.scandir(directory)
        if entry.name.endswith((".dist-info", ".egg-info"))
    )
    source = Path(__file__).resolve().parents[1]  # the timeshare package
    for path in sorted(source.rglob("*.py")):
        stat = path.stat()
        found.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\n".join(found)


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def _directory_stamp(value: str) -> str:
    """The files directly in `value` (name, size, time) if it names a directory; else ""."""
    if "/" not in value:
        return ""
    try:
        entries = sorted(os.scandir(value), key=lambda entry: entry.name)
        return "\n".join(
            f"{entry.name}:{entry.stat().st_size}:{entry.stat().st_mtime_ns}" for entry in entries
        )
    except OSError:  # not a directory (or gone): the payload's string is in the key already
        return ""


def _remember(passed: Path) -> None:
    passed.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=passed.parent, delete=False) as file:
        file.write("ok\n")
    os.replace(file.name, passed)  # whole or not at all, for a reader beside it
    # Keys of model directories that are gone, of timeshare's sources as they were: none is
    # asked again, so what was not written lately goes.
    stale = time.time() - KEEP_S
    for entry in os.scandir(passed.parent):
        if entry.stat().st_mtime < stale:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _run_check(module: str, payload: str, what: str, timeout_s: float) -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, payload],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"{what}: not checked within {timeout_s:g} s") from exc
    verdict = _last_json_line(done.stdout)
    if verdict is None:
        raise ConfigError(
            f"{what}: could not be checked (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    if not verdict.get("ok"):
        raise ConfigError(str(verdict.get("error")))


def answer(verdict: Mapping[str, object]) -> None:
    """The child's last line (libraries may print before it)."""
    sys.stdout.write("\n" + json.dumps(verdict) + "\n")


def _last_json_line(output: str) -> dict[str, object] | None:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None
