"""Logging set-up shared by the front ends and the worker processes.

With a log file, every process of a run appends structlog JSON lines to it (one line per event,
written whole, so processes do not tear each other's lines), rotated at `max_mb` (rotating.py:
`log.jsonl.1`, `.2`, ... up to `keep`); without one, events go to stderr:
readable on a terminal, JSON lines otherwise (`service=True`, the daemon under systemd), each
prefixed `<N>` with its syslog priority when stderr is the journal ($JOURNAL_STREAM). Events
carry the process id, and whatever is bound through contextvars (rank, role, step, phase,
engine). The stdlib's logging (pyzmq, torch, prometheus-client) goes through the same
processors and the same sink.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, cast

import msgspec
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from timeshare.errors import ConfigError
from timeshare.levels import LOG_LEVELS
from timeshare.rotating import MIB, RotatingFile

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
assert tuple(LEVELS) == LOG_LEVELS


# syslog priorities of the levels, for the journal's `<N>` prefix (sd-daemon(3))
PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}


def configure(
    level: str = "info",
    file: str = "",
    *,
    stderr_level: str = "warning",
    service: bool = False,
    max_mb: float = 0.0,
    keep: int = 0,
) -> None:
    """Where events go: JSON lines at `level` into `file` if given (rotated at `max_mb`, 0:
    never, `keep` old files); else stderr, at `stderr_level` (at `level` for a service),
    readable on a terminal, JSON otherwise."""
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_pid,
    ]
    if file:
        try:
            Path(file).parent.mkdir(parents=True, exist_ok=True)
            sink: TextIO = cast(TextIO, RotatingFile(Path(file), int(max_mb * MIB), keep))
        except OSError as exc:
            raise ConfigError(f"log.file: cannot open {file}: {exc}") from exc
        renderer: Processor = _json_renderer()
        threshold = level
    else:
        sink = sys.stderr
        tty = sink.isatty()
        journal = _is_journal(sink)  # workers of a service under systemd write JSON too
        renderer = (
            _json_renderer()
            if not tty and (service or journal)
            else structlog.dev.ConsoleRenderer(colors=False)
        )
        if journal:
            renderer = _with_priority(renderer)
        threshold = level if service else stderr_level
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[threshold]),
        logger_factory=structlog.WriteLoggerFactory(file=sink),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(shared, renderer, sink, threshold)


def set_level(level: str) -> None:
    """Change the threshold of this process's events (a reload, `timesharectl log-level`)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]))
    logging.getLogger().setLevel(LEVELS[level])


def _route_stdlib(shared: list[Processor], renderer: Processor, sink: TextIO, level: str) -> None:
    """Records of the stdlib's `logging` get the same processors, renderer and sink."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sink)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])


def _json_renderer() -> structlog.processors.JSONRenderer:
    return structlog.processors.JSONRenderer(serializer=_dumps)


_ENCODER = msgspec.json.Encoder(enc_hook=repr)


def _dumps(event: EventDict, default: Callable[[object], object]) -> str:
    """One event as JSON. msgspec writes a phase record (floats, spans) in about a third of
    `json.dumps`'s time, and the driver writes one per phase, on the cycle's path. A value or
    key it has no JSON for is written as its repr (as structlog's fallback writes a value);
    should msgspec still refuse an event, `json.dumps` writes it: no event is lost to this."""
    try:
        return _ENCODER.encode(event).decode()
    except (TypeError, ValueError, OverflowError):
        return json.dumps(event, default=default)


def _is_journal(stream: TextIO) -> bool:
    """Whether `stream` is the journal's stream ($JOURNAL_STREAM is `device:inode`)."""
    expected = os.environ.get("JOURNAL_STREAM")
    if not expected:
        return False
    try:
        status = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{status.st_dev}:{status.st_ino}"


def _with_priority(renderer: Processor) -> Processor:
    def render(logger: WrappedLogger, method: str, event: EventDict) -> str:
        text = renderer(logger, method, event)
        priority = PRIORITIES.get(str(event.get("level", method)), 6)
        return "\n".join(f"<{priority}>{line}" for line in str(text).splitlines())

    return render


def _add_pid(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    event["pid"] = os.getpid()
    return event
