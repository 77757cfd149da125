"""The stall rule: whether a worker's running call is alive, as pure functions of what its
heartbeats said and what the driver's clock saw.

Rules (the functions below are the truth; this comment explains them):

- A worker's call is idle while it makes no progress (`report_progress`, a bucket loaded, a
  batch generated) and is not waiting on its peer (whose own deadlines bound that wait). Idle
  time is the worker's to measure, by its own clock, and two kinds of time are left out of it
  because they are the machine's, not the call's: time the worker's control thread was held up
  (the process paused: a stopped VM, SIGSTOP, the GIL held) and time the threads of the worker
  and of the engine processes under it spent runnable but waiting for a CPU (a loaded machine,
  a CPU quota). A call that works on a starved machine is slow, not stalled.
- Of one heartbeat interval, what is left out is the larger of the two (a control thread held
  up because it waited for a CPU is one cause, counted once), never more than the interval.
- The driver judges a call from its worker's last heartbeat about it (`judge_call`):
  NO_PROGRESS when that heartbeat said idle past `stall_s`; NOT_STARTED when the heartbeats are
  about another call (one the worker would not let go of) for longer than `stall_s` since this
  one was sent; SILENT when no heartbeat came for `stall_s` of time the driver itself watched on
  schedule (its own lateness, a paused machine, restarts that clock: it blames no worker for
  time it did not watch), less the time the worker's threads waited for a CPU meanwhile (a
  starved worker is silent because it cannot run; a stopped one, or one stuck in C code holding
  the GIL, waits for no CPU). Otherwise ALIVE.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# A wait of the worker's control thread this much past its slice: the process was held up.
# Smaller lateness (scheduling jitter) is not counted: an endless loop holding the GIL in
# 5 ms turns would otherwise forgive itself a little of every interval.
HELD_UP_S = 0.1


class CallHealth(enum.Enum):
    ALIVE = "alive"
    NO_PROGRESS = "no progress"
    NOT_STARTED = "not started"
    SILENT = "silent"


@dataclass(frozen=True)
class CallSeen:
    """What the driver knows of one running call, at `now` (monotonic seconds)."""

    started: float  # when the call was sent
    heard_at: float  # the worker's last heartbeat
    on_this_call: bool  # that heartbeat was about this call
    idle_s: float  # how idle it said the call was (the worker's clock, machine time left out)
    watching_since: float  # since when the driver's own checks ran on schedule
    now: float
    # How long the worker's threads waited for a CPU since its last heartbeat: silence spent
    # so is the machine's (read only once the call looks silent without it).
    starved_s: float = 0.0


def judge_call(seen: CallSeen, stall_s: float) -> CallHealth:
    if seen.on_this_call and seen.idle_s > stall_s:
        return CallHealth.NO_PROGRESS
    if not seen.on_this_call and seen.heard_at > seen.started and seen.now - seen.started > stall_s:
        return CallHealth.NOT_STARTED
    silent_s = seen.now - max(seen.started, seen.heard_at, seen.watching_since) - seen.starved_s
    if silent_s > stall_s:
        return CallHealth.SILENT
    return CallHealth.ALIVE


def held_up_s(waited_s: float, allowed_s: float) -> float:
    """Of one wait of the control thread, the time the process was held up (0: on time)."""
    late_s = waited_s - allowed_s
    return late_s if late_s > HELD_UP_S else 0.0


def machine_time_s(interval_s: float, held_up_s: float, cpu_wait_s: float) -> float:
    """Of one heartbeat interval, the time that was the machine's, not the call's: left out of
    the call's idleness."""
    return max(0.0, min(interval_s, max(held_up_s, cpu_wait_s)))


def call_idle_s(
    now: float, progress_at: float, machine_s: float, *, busy: bool, waiting: bool
) -> float:
    """How idle the running call is: the time since its last progress less `machine_s`, the
    machine's time since then; 0 with no call, or while it waits on its peer."""
    if not busy or waiting:
        return 0.0
    return max(0.0, now - progress_at - machine_s)
