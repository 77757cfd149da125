"""What a run writes as it goes besides its log ([log].tensorboard, [log].trace), opened for a
front end and closed on every way out of it (`timeshare run` and `timeshared` alike)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import anyio

from timeshare.config import LogSection
from timeshare.errors import ConfigError
from timeshare.report.scalars import ScalarWriter
from timeshare.report.trace import TraceFile
from timeshare.rotating import MIB
from timeshare.timing import process_clock


@dataclass(frozen=True)
class RunWriters:
    scalars: ScalarWriter | None
    trace: TraceFile | None


async def open_writers(log: LogSection, stack: AsyncExitStack) -> RunWriters:
    """Open what `log` asks for, each closed when `stack` closes (its thread joined, even
    while cancelled); a path that cannot be written is a ConfigError naming its key."""
    trace = scalars = None
    if log.trace:
        try:
            # Its times count from this process's clock anchor, as `timeshare trace` would.
            origin = process_clock().wall_ns
            trace = await anyio.to_thread.run_sync(
                TraceFile, Path(log.trace), origin, int(log.max_mb * MIB), log.keep
            )
        except OSError as exc:
            raise ConfigError(f"log.trace: cannot write {log.trace}: {exc}") from exc
        stack.push_async_callback(close_off_loop, trace.close)
    if log.tensorboard:
        try:
            scalars = await anyio.to_thread.run_sync(ScalarWriter, Path(log.tensorboard))
        except OSError as exc:
            raise ConfigError(f"log.tensorboard: cannot write {log.tensorboard}: {exc}") from exc
        stack.push_async_callback(close_off_loop, scalars.close)
    return RunWriters(scalars, trace)


async def close_off_loop(close: Callable[[], None]) -> None:
    """A close that blocks (it joins a thread), off the event loop, even while cancelled."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(close)
