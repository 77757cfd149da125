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
- The CPU wait is one rule (`cpu_wait_s`), on both sides: of a stretch, the time the machine
  kept the call's process tree (the worker and the engine processes under it) from the CPUs it
  may run on, judged from how long its threads ran and waited in all. Never more than the
  stretch (threads that waited together are one wait), and nothing for a tree whose waits are
  for its own threads: a call spinning while its own engine oversubscribes the CPUs is stalled.
- The worker judges the stretch since its call's last progress (from its first heartbeat's
  reading after it) whole, not heartbeat by heartbeat: the kernel counts a wait once it has
  ended, often in a later interval than the one it filled. Of that stretch, what is left out
  is the larger of the two (a control thread held up because it waited for a CPU is one cause,
  counted once), never more than the stretch.
- The driver judges a call from its worker's last heartbeat about it (`judge_call`):
  NO_PROGRESS when that heartbeat said idle past `stall_s`; NOT_STARTED when the heartbeats are
  about another call (one the worker would not let go of) for longer than `stall_s` since this
  one was sent; SILENT when no heartbeat came for `stall_s` of time the driver itself watched on
  schedule (its own lateness, a paused machine, restarts that clock: it blames no worker for
  time it did not watch), less the CPU wait since that heartbeat, by the same rule (a starved
  worker is silent because it cannot run; a stopped one waits for no CPU, and one stuck in C
  code holding the GIL waits only as the machine's other work makes it). Otherwise ALIVE.
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
    # The CPU wait of the worker's process tree since its last heartbeat (`cpu_wait_s`): silence
    # spent so is the machine's (read only once the call looks silent without it).
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


def cpu_wait_s(stretch_s: float, ran_s: float, waited_s: float, cpus: int) -> float:
    """Of a stretch of `stretch_s`, the time the machine kept the call from a CPU: the rule for
    the worker's idleness and the driver's silence alike. From what the threads of the call's
    process tree (the worker's and its engine processes') did meanwhile, summed over them:
    `ran_s` on a CPU, `waited_s` runnable but waiting for one (schedstat's run_delay, which a
    CPU quota's throttling adds to); `cpus`, how many CPUs the tree may run on.

    Had the machine been the tree's alone, the tree would have had all the CPU time it wanted
    (ran_s + waited_s), up to what its CPUs give in the stretch: `fair_s`. It had ran_s: its
    work went at ran_s / fair_s of that pace, and the rest of the stretch was the machine's.
    So a tree starved outright (its quota spent, its CPUs taken) is forgiven the stretch, once,
    however many of its threads waited; one that had its CPUs to itself is forgiven nothing,
    however long its threads waited for each other (an engine oversubscribing its own CPUs, a
    call spinning beside it); one whose CPUs others shared is forgiven their share. And never
    more than `waited_s`: the call was held up only while some thread of it waited (this
    bounds a tree that wanted a CPU now and then, one thread asleep most of the stretch).

    Neither the sum of the threads' waits (k threads waiting together forgive k times the
    time) nor the largest of them (beside an engine's k busy threads on fewer CPUs, every
    thread waits most of the time, for the others) says how long the machine held the call.
    The sums say how much, not when: a tree that oversubscribes its CPUs in bursts, idle
    between them, reads as wanting them evenly and is forgiven a little of its own waits; and
    a CPU quota is the machine's, as a loaded machine is, even where the tree's own threads
    are what use it up.
    """
    fair_s = min(ran_s + waited_s, cpus * stretch_s)
    if fair_s <= 0.0:
        return 0.0
    return max(0.0, min(waited_s, stretch_s * (1.0 - ran_s / fair_s)))


def machine_time_s(stretch_s: float, held_up_s: float, cpu_wait_s: float) -> float:
    """Of a stretch without progress, the time that was the machine's, not the call's: left out
    of the call's idleness."""
    return max(0.0, min(stretch_s, max(held_up_s, cpu_wait_s)))


def call_idle_s(
    now: float, progress_at: float, machine_s: float, *, busy: bool, waiting: bool
) -> float:
    """How idle the running call is: the time since its last progress less `machine_s`, the
    machine's time since then; 0 with no call, or while it waits on its peer."""
    if not busy or waiting:
        return 0.0
    return max(0.0, now - progress_at - machine_s)
