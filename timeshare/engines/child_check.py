"""Ask an engine's own library whether it accepts a config, in a child process.

Importing vLLM or transformers takes seconds and sets process-wide state that a daemon should
not carry, so the checks made at config load (before any worker starts) run as

    python -m <module> '<payload as JSON>'

and the child prints one JSON line last: `{"ok": true}` or `{"ok": false, "error": ...}`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping

from timeshare.errors import ConfigError


def ask_child(module: str, payload: str, what: str, timeout_s: float) -> None:
    """Run `module`'s check; a `ConfigError` with its error, or saying why it could not answer."""
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
