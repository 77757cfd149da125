"""Logging set-up shared by the front ends and the worker processes.

With a log file, every process of a run appends structlog JSON lines to it (one line per event,
written whole, so processes do not tear each other's lines); without one, events at `level` and
above go to stderr, readable. Events carry the process id, and whatever is bound through
contextvars (rank, role, step, phase).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

from timeshare.errors import ConfigError

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(level: str = "info", file: str = "", *, stderr_level: str = "warning") -> None:
    """JSON lines at `level` into `file` if given, else console lines at `stderr_level`."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_pid,
    ]
    if file:
        try:
            Path(file).parent.mkdir(parents=True, exist_ok=True)
            sink: TextIO = open(file, "a", buffering=1)  # noqa: SIM115 - lives with the process
        except OSError as exc:
            raise ConfigError(f"log.file: cannot open {file}: {exc}") from exc
        renderer: Any = structlog.processors.JSONRenderer()
        threshold = LEVELS[level]
    else:
        sink = sys.stderr
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        threshold = LEVELS[stderr_level]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.WriteLoggerFactory(file=sink),
        cache_logger_on_first_use=False,
    )


def _add_pid(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    event["pid"] = os.getpid()
    return event
