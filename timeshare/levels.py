"""The log levels every front accepts: the config's `[log].level`, the control socket's
`set_log_level`, `timesharectl log-level`. Apart from logs.py so that reading a config or
running `timesharectl` does not load the logging library."""

from __future__ import annotations

from typing import Literal, get_args

LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
