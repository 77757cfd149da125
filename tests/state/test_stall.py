"""The stall rule, case by case: what the driver makes of a call, and what the worker leaves
out of its idleness."""

from __future__ import annotations

import pytest

from timeshare.state.stall import (
    HELD_UP_S,
    CallHealth,
    CallSeen,
    call_idle_s,
    cpu_wait_s,
    held_up_s,
    judge_call,
    machine_time_s,
)

H = CallHealth
STALL_S = 10.0

# (started, heard_at, on_this_call, idle_s, watching_since, now) -> health; the call was sent at
# 100 s by the driver's clock.
CASES: list[tuple[str, CallSeen, CallHealth]] = [
    ("just sent, nothing heard yet", CallSeen(100, 99, False, 0, 0, 101), H.ALIVE),
    ("progressing", CallSeen(100, 108, True, 0.4, 0, 108.1), H.ALIVE),
    ("idle, under the limit", CallSeen(100, 109, True, 9.9, 0, 109.1), H.ALIVE),
    ("idle past the limit", CallSeen(100, 111, True, 10.1, 0, 111.1), H.NO_PROGRESS),
    ("idle exactly the limit: not yet", CallSeen(100, 110, True, 10.0, 0, 110.1), H.ALIVE),
    # A long call, starved: the worker left its CPU wait out, so it says little idleness.
    ("long call, starved, honest", CallSeen(100, 160, True, 2.0, 0, 160.2), H.ALIVE),
    ("on another call, briefly", CallSeen(100, 105, False, 0, 0, 105.1), H.ALIVE),
    ("on another call past the limit", CallSeen(100, 110.5, False, 0, 0, 110.6), H.NOT_STARTED),
    # Heartbeats about the previous call, all heard before this one was sent: silence.
    ("heard only before the call", CallSeen(100, 99, False, 0, 0, 110.5), H.SILENT),
    ("silent past the limit", CallSeen(100, 100.5, True, 0, 0, 110.6), H.SILENT),
    ("silent, but the driver was late", CallSeen(100, 100.5, True, 0, 105, 110.6), H.ALIVE),
    ("silent since the driver's lateness", CallSeen(100, 100.5, True, 0, 105, 115.1), H.SILENT),
    # Silent because it waited for a CPU (starved): the machine's time, not a stall ...
    ("silent, starved", CallSeen(100, 100.5, True, 0, 0, 112, starved_s=8), H.ALIVE),
    # ... but a worker stopped, or stuck in C code holding the GIL, waits for no CPU.
    ("silent, barely starved", CallSeen(100, 100.5, True, 0, 0, 112, starved_s=1), H.SILENT),
    # Idle past the limit wins over silence: its heartbeat said so.
    ("idle and then silent", CallSeen(100, 111, True, 10.5, 0, 125), H.NO_PROGRESS),
]


@pytest.mark.parametrize(("seen", "health"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_driver_judges_a_call_by_the_table(seen: CallSeen, health: CallHealth) -> None:
    assert judge_call(seen, STALL_S) is health


def test_every_verdict_is_reachable() -> None:
    assert {health for *_, health in CASES} == set(CallHealth)


@pytest.mark.parametrize(
    ("waited_s", "allowed_s", "held"),
    [
        (0.05, 0.05, 0.0),  # on time
        (0.04 + HELD_UP_S, 0.05, 0.0),  # jitter under the threshold: not counted
        (0.30, 0.05, 0.25),  # held up: all its lateness
        (3.05, 0.05, 3.0),  # a paused VM, a SIGSTOP
    ],
)
def test_lateness_of_a_wait_past_the_threshold_is_held_up_time(
    waited_s: float, allowed_s: float, held: float
) -> None:
    assert held_up_s(waited_s, allowed_s) == pytest.approx(held)


@pytest.mark.parametrize(
    ("interval_s", "held", "cpu_wait", "left_out"),
    [
        (0.5, 0.0, 0.0, 0.0),  # a machine to itself
        (0.5, 0.0, 0.4, 0.4),  # runnable, waiting for a CPU, most of the interval
        (0.5, 0.3, 0.0, 0.3),  # the process held up (stopped, paused)
        (0.5, 0.3, 0.4, 0.4),  # held up because it waited for a CPU: one cause, counted once
        (0.5, 0.0, 0.9, 0.5),  # never more than the interval itself
        (0.5, -0.1, -0.2, 0.0),  # (a clock read backwards gives nothing)
    ],
)
def test_the_machines_time_in_an_interval_is_left_out_once(
    interval_s: float, held: float, cpu_wait: float, left_out: float
) -> None:
    assert machine_time_s(interval_s, held, cpu_wait) == pytest.approx(left_out)


# (interval_s, ran_s, waited_s, cpus) -> the CPU wait forgiven: ran and waited summed over
# the threads of the worker's process tree.
CPU_WAITS: list[tuple[str, tuple[float, float, float, int], float]] = [
    ("one thread, a machine to itself", (1.0, 1.0, 0.0, 2), 0.0),
    ("one thread, its CPU shared half with others", (1.0, 0.5, 0.5, 2), 0.5),
    ("a tenth of a CPU (a quota), one busy thread", (1.0, 0.1, 0.9, 2), 0.9),
    # Threads that waited together are one wait: the interval, once, not four times.
    ("four threads starved outright", (1.0, 0.0, 4.0, 2), 1.0),
    # Waits for its own threads are the tree's: an engine's nine busy threads on two CPUs.
    ("a tree oversubscribing its own CPUs", (1.0, 2.0, 7.0, 2), 0.0),
    ("the same tree, others holding half its CPUs", (1.0, 1.0, 8.0, 2), 0.5),
    ("two threads on four CPUs, each shared half", (1.0, 1.0, 1.0, 4), 0.5),
    # Held up only while it wanted a CPU: a thread asleep most of the interval.
    ("wanting a CPU a fifth of the time", (1.0, 0.1, 0.1, 2), 0.1),
    ("stopped: waiting for none", (1.0, 0.0, 0.0, 2), 0.0),
    ("(read across a step of the clock: never below 0)", (1.0, 2.5, 0.5, 2), 0.0),
]


@pytest.mark.parametrize(
    ("read", "forgiven"), [c[1:] for c in CPU_WAITS], ids=[c[0] for c in CPU_WAITS]
)
def test_the_cpu_wait_is_the_machines_share_of_the_interval(
    read: tuple[float, float, float, int], forgiven: float
) -> None:
    assert cpu_wait_s(*read) == pytest.approx(forgiven)


def test_the_cpu_wait_is_never_more_than_the_interval_nor_the_threads_waits() -> None:
    steps = [0.0, 0.05, 0.3, 1.0, 2.5, 9.0]
    for ran in steps:
        for waited in steps:
            for cpus in (1, 2, 8):
                forgiven = cpu_wait_s(1.0, ran, waited, cpus)
                assert 0.0 <= forgiven <= min(1.0, waited), (ran, waited, cpus)


def test_a_call_is_idle_only_while_busy_and_not_waiting_on_its_peer() -> None:
    assert call_idle_s(20.0, 12.0, 0.0, busy=True, waiting=False) == 8.0
    assert call_idle_s(20.0, 12.0, 0.0, busy=True, waiting=True) == 0.0
    assert call_idle_s(20.0, 12.0, 0.0, busy=False, waiting=False) == 0.0


def test_the_machines_time_since_progress_is_not_idleness() -> None:
    assert call_idle_s(20.0, 12.0, 5.0, busy=True, waiting=False) == 3.0  # 5 s of CPU wait
    assert call_idle_s(20.0, 12.0, 9.0, busy=True, waiting=False) == 0.0  # (never below 0)
