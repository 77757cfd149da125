"""Command lanes with real worker processes: results, typed failures, exits, stalls, abort."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.conftest import socket_files
from tests.starving import cpu_starved
from timeshare.errors import (
    CommandTimeout,
    ProtocolError,
    WorkerDied,
    WorkerError,
    WorkerStalled,
)
from timeshare.protocols.commands import WorkerId, WorkerLanes, frames, watch_process
from timeshare.protocols.commands.cpu_wait import cpus, tree_cpu_time
from timeshare.protocols.commands.driver_side import ABORT_S, CHECK_S
from timeshare.protocols.commands.lane_server import PendingCall
from timeshare.protocols.commands.lane_socket import HEADER, MAX_FRAME, FrameReader, pack
from timeshare.protocols.commands.results import WorkerStatus

ROOT = Path(__file__).resolve().parents[2]
TRAINER = WorkerId("trainer", 1)
BEAT_S = 0.1  # lane_worker's heartbeat
# The call's way to the worker and the heartbeat's back (a frame on a UNIX socket each), and
# the worker's reading of its tree at that beat (its GIL shared with the call's loop).
LATENCY_S = 0.2
OWN_SCHEDSTAT = Path("/proc/thread-self/schedstat")


@dataclass
class Stretch:
    """A stretch of a test: how long it took, and what the worker's process tree did with the
    CPUs meanwhile (summed over its threads, as cpu_wait.py reads them)."""

    took_s: float = 0.0
    ran_s: float = 0.0  # on a CPU
    waited_s: float = 0.0  # runnable, waiting for one
    cpus: int = 1  # that it may run on
    own_wait_s: float = 0.0  # this test's thread's (the driver's) wait for a CPU

    @property
    def others_s(self) -> float:
        """For a tree that wanted all its CPUs all the stretch: how long the machine's other
        work held them (the CPU time of them it did not get, per CPU)."""
        return max(0.0, self.took_s - self.ran_s / self.cpus)


@contextmanager
def until_given_up(lanes: WorkerLanes, pid: int) -> Iterator[Stretch]:
    """From now until the driver gives up on a call of the worker `pid` (it is about to abort
    it: the time its answer to the abort takes is not counted), or the block's end."""
    stretch = Stretch(cpus=cpus(pid))
    then, own_then, started = tree_cpu_time(pid), _own_wait_ns(), time.monotonic()

    def end() -> None:
        if stretch.took_s == 0.0:
            now = tree_cpu_time(pid)
            stretch.took_s = time.monotonic() - started
            stretch.ran_s = (now.ran_ns - then.ran_ns) * 1e-9
            stretch.waited_s = (now.waited_ns - then.waited_ns) * 1e-9
            stretch.own_wait_s = (_own_wait_ns() - own_then) * 1e-9

    abort = lanes._abort

    async def ending(pending: PendingCall) -> None:
        end()
        await abort(pending)

    setattr(lanes, "_abort", ending)  # noqa: B010 - (a method, replaced for the block)
    try:
        yield stretch
    finally:
        setattr(lanes, "_abort", abort)  # noqa: B010
        end()


def _own_wait_ns() -> int:
    try:
        return int(OWN_SCHEDSTAT.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


@asynccontextmanager
async def one_worker(
    runtime_dir: Path, *, stall_timeout_s: float = 5.0
) -> AsyncIterator[tuple[WorkerLanes, subprocess.Popen[str]]]:
    async with WorkerLanes.open(runtime_dir, stall_timeout_s=stall_timeout_s) as lanes:
        lanes.expect(TRAINER)
        spec = {
            "work": lanes.work_endpoint,
            "control": lanes.control_endpoint,
            "role": TRAINER.role,
            "rank": TRAINER.rank,
        }
        argv = [sys.executable, "-m", "tests.protocols.lane_worker", json.dumps(spec)]
        process = await anyio.to_thread.run_sync(partial(subprocess.Popen, argv, cwd=ROOT))
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watch_process, lanes, TRAINER, process)
                await lanes.wait_ready([TRAINER], timeout_s=60.0)
                yield lanes, process
                if process.poll() is None:
                    await lanes.call(TRAINER, "shutdown", deadline_s=10.0, returns=object)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


async def status_once_busy(lanes: WorkerLanes, command: str, timeout_s: float = 10.0) -> Any:
    """The trainer's status once it reports `command` busy, or its last status at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await lanes.control(TRAINER, "status", timeout_s=5.0, returns=WorkerStatus)
        if status.busy == command or time.monotonic() > deadline:
            return status
        await anyio.sleep(0.02)


@pytest.mark.asyncio
async def test_results_and_typed_remote_errors(runtime_dir: Path) -> None:
    async with one_worker(runtime_dir) as (lanes, process):
        assert await lanes.call(
            TRAINER, "echo", {"x": [1, 2]}, deadline_s=10.0, returns=object
        ) == {"x": [1, 2]}
        with pytest.raises(WorkerError) as info:
            await lanes.call(TRAINER, "raise", {"batch": 7}, deadline_s=10.0, returns=object)
        error = info.value
        assert (error.rank, error.role, error.command) == (1, "trainer", "raise")
        assert (error.remote_type, error.remote_message) == ("ValueError", "bad batch 7")
        assert "trainer rank 1 failed in raise: ValueError: bad batch 7" in str(error)
        with pytest.raises(WorkerError, match="UnknownCommand"):
            await lanes.call(TRAINER, "nope", deadline_s=10.0, returns=object)
        # Still serving after failures.
        assert await lanes.call(TRAINER, "echo", {}, deadline_s=10.0, returns=object) == {}
    assert process.returncode == 0
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_a_worker_that_dies_is_seen_at_once(runtime_dir: Path) -> None:
    async with one_worker(runtime_dir) as (lanes, _):
        started = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            await lanes.call(TRAINER, "die", deadline_s=60.0, returns=object)
        assert time.monotonic() - started < 1.0  # the exit itself, not a deadline
        assert info.value.returncode == -signal.SIGKILL and info.value.command == "die"
        assert "trainer rank 1 exited during die with signal 9" in str(info.value)
        with pytest.raises(WorkerDied):  # and every later call knows
            await lanes.call(TRAINER, "echo", deadline_s=10.0, returns=object)
    assert socket_files(runtime_dir) == []


@pytest.mark.asyncio
async def test_no_progress_is_a_stall_but_slow_progress_is_alive(runtime_dir: Path) -> None:
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, worker):
        # 2.5 s of work reporting progress every 0.1 s: longer than the stall timeout, alive.
        assert await lanes.call(
            TRAINER, "work", {"seconds": 2.5}, deadline_s=30.0, returns=object
        ) == {"steps": 25}
        with (
            until_given_up(lanes, worker.pid) as hung,
            pytest.raises(WorkerStalled, match="made no progress in hang for 1 s"),
        ):
            await lanes.call(TRAINER, "hang", deadline_s=30.0, returns=object)
        # Within the stall timeout and a beat of the worker's own time, not counting the time
        # its threads waited for a CPU (on a machine loaded past its cores; left out of its
        # idleness on purpose): far below the call's deadline of 30 s.
        assert hung.took_s - hung.waited_s < 1.0 + 1.0, hung
        # The stalled call was aborted before the error: the worker is free again (a hang that
        # went on would leave it busy, and this echo unanswered behind it).
        status = await lanes.control(TRAINER, "status", timeout_s=5.0, returns=WorkerStatus)
        assert status.busy is None
        echo = await lanes.call(TRAINER, "echo", {"n": 1}, deadline_s=5.0, returns=object)
        assert echo == {"n": 1}


@pytest.mark.asyncio
async def test_a_driver_held_up_blames_no_worker_for_the_time_it_did_not_watch(
    runtime_dir: Path,
) -> None:
    """The machine pauses (here: the worker stopped, the driver's loop blocked) for longer than
    the stall timeout while the worker waits on its peer, and the driver's checks resume a
    moment before the worker's heartbeats do. Judged by the driver's clock alone, the first
    check after the pause sees 2.5 s without a heartbeat: a stall that never was."""
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, process):

        async def pause_everything() -> None:
            await anyio.sleep(0.5)
            process.send_signal(signal.SIGSTOP)
            time.sleep(2.5)  # noqa: ASYNC251 - the paused machine: nothing of the driver runs
            await anyio.sleep(0.3)  # the driver's checks run again (every 0.05 s) ...
            process.send_signal(signal.SIGCONT)  # ... before the worker's next heartbeat

        async with anyio.create_task_group() as group:
            group.start_soon(pause_everything)
            waited = await lanes.call(
                TRAINER, "wait_on_peer", {"seconds": 4.0}, deadline_s=30.0, returns=object
            )
        assert waited == {"waited": 4.0}


@pytest.mark.asyncio
async def test_a_worker_silent_while_the_driver_watches_is_a_stall(runtime_dir: Path) -> None:
    """Stopped mid-call (as a worker stuck in C code holding the GIL sends no heartbeat): no
    heartbeat for the stall timeout, with the driver checking on schedule, is WorkerStalled."""
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, process):

        async def stop_soon() -> None:
            await anyio.sleep(0.5)
            process.send_signal(signal.SIGSTOP)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stop_soon)
                with pytest.raises(WorkerStalled, match="sent no heartbeat in work for 1 s"):
                    await lanes.call(
                        TRAINER, "work", {"seconds": 20.0}, deadline_s=30.0, returns=object
                    )
        finally:
            process.send_signal(signal.SIGCONT)


@pytest.mark.asyncio
async def test_a_call_the_worker_never_starts_is_a_stall(runtime_dir: Path) -> None:
    """The worker is still stuck in a call it was told to abort (as C code would be): the next
    call is never started, and its heartbeats, about the old call, say so."""
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, process):
        with pytest.raises(WorkerStalled, match="made no progress in hang_hard for 1 s"):
            await lanes.call(TRAINER, "hang_hard", deadline_s=30.0, returns=object)
        started = time.monotonic()
        with pytest.raises(WorkerStalled, match=r"in echo for 1 s \(it has not started it\)"):
            await lanes.call(TRAINER, "echo", deadline_s=30.0, returns=object)
        assert time.monotonic() - started < 1.0 + ABORT_S + 2.0  # (the abort, unanswered)
        process.kill()  # (it would not answer `shutdown` either)
        await anyio.to_thread.run_sync(process.wait)


@pytest.mark.asyncio
async def test_deadline_applies_even_while_progressing(runtime_dir: Path) -> None:
    async with one_worker(runtime_dir, stall_timeout_s=5.0) as (lanes, _):
        with pytest.raises(CommandTimeout, match="did not finish work within 1 s"):
            await lanes.call(TRAINER, "work", {"seconds": 3.0}, deadline_s=1.0, returns=object)
        # The late result is dropped; the next call gets its own answer. Called at once, while the
        # work still runs: the worker runs one call at a time and the lane keeps order, so the
        # late result surely reaches the driver first, while this call waits for its own answer.
        assert await lanes.call(
            TRAINER, "echo", {"after": True}, deadline_s=10.0, returns=object
        ) == {"after": True}


@pytest.mark.asyncio
async def test_control_lane_answers_while_work_runs_and_abort_interrupts(runtime_dir: Path) -> None:
    async with one_worker(runtime_dir, stall_timeout_s=30.0) as (lanes, _):
        outcome: dict[str, Any] = {}

        async def run_hang() -> None:
            try:
                await lanes.call(TRAINER, "hang", deadline_s=60.0, returns=object)
            except WorkerError as exc:
                outcome["error"] = exc
                outcome["at"] = time.monotonic()

        async with anyio.create_task_group() as group:
            group.start_soon(run_hang)
            status = await status_once_busy(lanes, "hang")
            assert status.busy == "hang" and status.role == "trainer"
            asked = time.monotonic()
            assert await lanes.control(TRAINER, "abort", timeout_s=5.0, returns=object) == "hang"
        # The abort's answer, not the stall (30 s) or the deadline (60 s): a moment here, a few
        # seconds on a machine loaded past its cores.
        assert outcome["at"] - asked < 10.0
        assert outcome["error"].remote_type == "Aborted"
        idle = await lanes.control(TRAINER, "status", timeout_s=5.0, returns=WorkerStatus)
        assert idle.busy is None
        assert (
            await lanes.control(TRAINER, "abort", timeout_s=5.0, returns=object) is None
        )  # nothing to abort
        assert await lanes.call(TRAINER, "echo", {"ok": 1}, deadline_s=10.0, returns=object) == {
            "ok": 1
        }


@pytest.mark.asyncio
async def test_garbage_on_a_lane_is_ignored_and_calls_go_on(runtime_dir: Path) -> None:
    rogue = WorkerId("rogue", 0)
    async with one_worker(runtime_dir) as (lanes, _):
        streams: list[anyio.abc.SocketStream] = []
        try:
            # A rogue peer on each lane (wait_ready wants a hello on both): garbage, then a hello.
            for lane, url in (("work", lanes.work_endpoint), ("control", lanes.control_endpoint)):
                stream = await anyio.connect_unix(url.removeprefix("ipc://"))
                streams.append(stream)
                await stream.send(pack(b"\xc1\xc1 not msgpack"))
                beat = frames.encode(frames.Heartbeat(None, None, 1))
                await stream.send(pack(beat))  # before its hello: nobody's
                await stream.send(pack(b"\x81\xa4kind\xa6result"))  # a reply to no call
                # Then a hello: a lane reads one peer's frames in order, so once the driver has
                # seen it, it has read (and dropped) the garbage sent before it.
                await stream.send(
                    pack(frames.encode(frames.Hello(rogue.role, rogue.rank, 0, lane)))
                )
            await lanes.wait_ready([rogue], timeout_s=10.0)
            # A peer whose stream cannot be framed (a length past the limit) is cut off alone.
            broken = await anyio.connect_unix(lanes.work_endpoint.removeprefix("ipc://"))
            streams.append(broken)
            await broken.send(HEADER.pack(MAX_FRAME + 1))
            with anyio.fail_after(10.0), pytest.raises(anyio.EndOfStream):
                await broken.receive()  # the driver closed it
        finally:
            for opened in streams:
                await opened.aclose()
        assert await lanes.call(
            TRAINER, "echo", {"still": "fine"}, deadline_s=10.0, returns=object
        ) == {"still": "fine"}
        status = await lanes.control(TRAINER, "status", timeout_s=5.0, returns=WorkerStatus)
        assert status.busy is None and status.role == "trainer"
    assert socket_files(runtime_dir) == []


def test_frames_are_cut_out_of_any_chunking() -> None:
    stream = b"".join(pack(frame) for frame in (b"one", b"", b"three" * 1000))
    for chunk in (1, 3, 7, len(stream)):
        reader = FrameReader()
        got = [f for i in range(0, len(stream), chunk) for f in reader.feed(stream[i : i + chunk])]
        assert got == [b"one", b"", b"three" * 1000], chunk
    with pytest.raises(ProtocolError, match="over the lane's"):
        FrameReader().feed(HEADER.pack(MAX_FRAME + 1))


class _Exits:
    def __init__(self) -> None:
        self.exits: list[tuple[WorkerId, int]] = []

    def worker_exited(self, worker: WorkerId, returncode: int, why: str | None = None) -> None:
        self.exits.append((worker, returncode))


@pytest.mark.asyncio
async def test_an_exit_another_thread_is_reaping_is_still_reported() -> None:
    """`Popen.poll` answers None while another thread is inside `wait()` (it holds the Popen's
    waitpid lock): the exit is reported once that wait has reaped the process, not lost to an
    assertion (a test that waited for its worker in a thread failed so, 1 run in ~10)."""
    argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
    process = await anyio.to_thread.run_sync(partial(subprocess.Popen, argv))
    exits = _Exits()
    pidfd = os.pidfd_open(process.pid)
    lock = process._waitpid_lock  # type: ignore[attr-defined]  # held as a waiting thread does
    lock.acquire()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(watch_process, exits, TRAINER, process)
            with anyio.fail_after(30):
                await anyio.wait_readable(pidfd)  # it has exited (a zombie: not yet reaped)
            await anyio.sleep(0.2)  # the watch saw it too, and poll() said None
            assert exits.exits == []
            lock.release()  # the "wait" returns: the watch reports the exit
    finally:
        os.close(pidfd)
        if lock.locked():
            lock.release()
    assert exits.exits == [(TRAINER, 3)]


@pytest.mark.asyncio
async def test_a_call_starved_of_cpu_is_slow_not_stalled(runtime_dir: Path) -> None:
    """A stretch of work with no progress reported, which takes 0.3 s of CPU: alone, well
    inside the 1 s stall timeout; held to a tenth of a CPU (a quota, a loaded machine), about
    3 s. The time it waited for a CPU is the machine's, not the call's: it is not a stall."""
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, process):
        with cpu_starved([process.pid], 0.1) as how:
            started = time.monotonic()
            computed = await lanes.call(
                TRAINER, "compute", {"cpu_s": 0.3}, deadline_s=60.0, returns=object
            )
            took_s = time.monotonic() - started
        assert computed == {"computed": 0.3}
        assert took_s > 1.5, (how, took_s)  # it was starved: longer than the stall timeout


@pytest.mark.asyncio
async def test_an_endless_loop_is_a_stall_within_the_timeout_and_a_beat(
    runtime_dir: Path,
) -> None:
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, worker):
        with (
            until_given_up(lanes, worker.pid) as spun,
            pytest.raises(WorkerStalled, match="made no progress in spin for 1 s"),
        ):
            await lanes.call(TRAINER, "spin", deadline_s=30.0, returns=object)
    # Given up on after the stall timeout, a heartbeat and the driver's check, of the time the
    # loop could run: on a machine loaded past its cores, its waits for a CPU are the machine's
    # time, left out of its idleness (one thread wanting a CPU: what its tree waited), as are
    # this test's own.
    spent_s = spun.took_s - spun.waited_s - spun.own_wait_s
    assert spent_s < 1.0 + BEAT_S + CHECK_S + LATENCY_S, spun


@pytest.mark.asyncio
async def test_a_call_spinning_beside_its_busy_engine_is_a_stall(runtime_dir: Path) -> None:
    """The worker's engine runs four busy processes per CPU, and the call spins beside them:
    every thread of the tree waits for a CPU most of the time, but for its own threads, not for
    the machine. That is no time to forgive: the stall is seen after the stall timeout and a
    beat, late only by the time the machine's other work held the tree's CPUs. (Forgiving the
    largest wait of any one thread, the loop is forgiven three quarters of every interval; the
    sum of them, all of it.)"""
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, worker):
        processes = 4 * cpus(worker.pid)
        await lanes.call(
            TRAINER, "start_engine", {"processes": processes}, deadline_s=60.0, returns=object
        )
        with (
            until_given_up(lanes, worker.pid) as spun,
            pytest.raises(WorkerStalled, match="made no progress in spin for 1 s"),
        ):
            await lanes.call(TRAINER, "spin", deadline_s=30.0, returns=object)
        await lanes.call(TRAINER, "stop_engine", deadline_s=30.0, returns=object)
    # The tree wanted more than its CPUs all along: its threads waited for them, in all, for
    # more than the CPUs' own time.
    assert spun.waited_s > spun.cpus * spun.took_s, spun
    spent_s = spun.took_s - spun.others_s - spun.own_wait_s
    assert spent_s < 1.0 + BEAT_S + CHECK_S + LATENCY_S, spun


@pytest.mark.asyncio
async def test_a_worker_stuck_in_c_code_beside_its_busy_engine_is_silent_and_stalled(
    runtime_dir: Path,
) -> None:
    """As above, with the loop in C code holding the GIL: no heartbeat comes, and the driver
    reads the tree's CPU wait since the last one by the same rule. Its threads waited for each
    other: the silence is the worker's, seen after the stall timeout (then the abort, which
    it cannot take, is waited for). Forgiving the sum of the worker's threads' waits (as the
    driver did) forgave the loop most of its silence."""
    async with one_worker(runtime_dir, stall_timeout_s=1.0) as (lanes, worker):
        processes = 4 * cpus(worker.pid)
        await lanes.call(
            TRAINER, "start_engine", {"processes": processes}, deadline_s=60.0, returns=object
        )
        with (
            until_given_up(lanes, worker.pid) as stuck,
            pytest.raises(WorkerStalled, match="sent no heartbeat in spin_in_c for 1 s"),
        ):
            await lanes.call(TRAINER, "spin_in_c", deadline_s=30.0, returns=object)
        worker.kill()  # (its engine's processes end with it)
        await anyio.to_thread.run_sync(worker.wait)
    assert stuck.waited_s > stuck.cpus * stuck.took_s, stuck
    # Its last heartbeat came at most a beat after the call did.
    spent_s = stuck.took_s - stuck.others_s - stuck.own_wait_s
    assert spent_s < 1.0 + BEAT_S + CHECK_S + LATENCY_S, stuck
