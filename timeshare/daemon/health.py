"""The daemon's health: how late its event loop runs, and whether systemd's watchdog is fed.

The watchdog is fed while the cycle makes progress, and whenever nothing is supposed to move
(idle, paused): a daemon paused on purpose for an hour is not stuck. A running cycle that made
no transition for longer than any of its deadlines allows is, and systemd restarts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from timeshare.config import DeadlineSection
from timeshare.state.service import MOVING, ServiceLifecycle

LAG_PROBE_S = 0.01


def watchdog_fed(
    state: ServiceLifecycle, cycle_runs: bool, since_progress_s: float, deadlines: DeadlineSection
) -> bool:
    """Whether the watchdog should be fed: a cycle that runs must have moved lately."""
    if state not in MOVING or not cycle_runs:
        return True  # idle or paused: nothing is supposed to move
    longest = max([deadlines.phase_s, deadlines.ready_s, *deadlines.commands.values()])
    return since_progress_s < longest + deadlines.stall_s


class LoopLag:
    """How late the event loop wakes a sleeper: what every control request waits at worst."""

    def __init__(self) -> None:
        self.max_s = 0.0

    async def measure(self, on_new_max: Callable[[float], None]) -> None:
        """Probe every LAG_PROBE_S until cancelled; tell each new worst."""
        while True:
            before = time.monotonic()
            await anyio.sleep(LAG_PROBE_S)
            lag = time.monotonic() - before - LAG_PROBE_S
            if lag > self.max_s:
                self.max_s = lag
                on_new_max(lag)
