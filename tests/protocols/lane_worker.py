"""A worker for the command-lane tests: `python -m tests.protocols.lane_worker ARGS`.

ARGS (JSON): work, control (endpoints), role, rank, heartbeat_s. Handlers: echo, work (sleeps
in steps, reporting progress), hang (waits forever without progress), wait_on_peer (sleeps
marked as a wait on its peer), hang_hard (a hang that an abort does not end, as in C code),
compute (CPU work without progress), spin (an endless loop in Python), spin_in_c (an endless
loop in C code holding the GIL: no heartbeat, no abort), start_engine and stop_engine (busy
processes under the worker, as an engine's are), raise, die (SIGKILL self).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from timeshare.errors import Aborted
from timeshare.protocols.commands import WorkerServer

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

# An engine's process that wants a CPU all the time, until the worker that started it is gone.
BUSY = "import os\nworker = os.getppid()\nwhile os.getppid() == worker: pass\n"


def as_mapping(handler: Callable[[dict[str, Any]], Any]) -> Callable[[msgspec.Raw], Any]:
    """A handler of these tests takes its params as a plain mapping (the engines' handlers
    decode theirs as a typed Struct: protocols/commands/params.py)."""
    return lambda raw: handler(msgspec.msgpack.decode(raw))


def main() -> None:
    args = json.loads(sys.argv[1])
    server: WorkerServer

    def echo(params: dict[str, Any]) -> Any:
        return params

    def work(params: dict[str, Any]) -> Any:
        steps = int(params["seconds"] / 0.1)
        for _ in range(steps):
            time.sleep(0.1)
            server.report_progress()
        return {"steps": steps}

    def compute(params: dict[str, Any]) -> Any:
        """`cpu_s` of this thread's CPU time, with no progress reported: a stretch of work."""
        end = time.thread_time() + params["cpu_s"]
        while time.thread_time() < end:
            pass
        return {"computed": params["cpu_s"]}

    def spin(params: dict[str, Any]) -> Any:
        while True:  # an endless loop that makes no progress (interruptible: Python code)
            pass

    def spin_in_c(params: dict[str, Any]) -> Any:
        # Backtracking without end (2^64 ways to fail) inside the regex engine, which holds the
        # GIL throughout: the control thread sends no heartbeat and cannot deliver an abort.
        return re.match(r"(a*)*b", "a" * 64) is not None

    engine: list[subprocess.Popen[bytes]] = []

    def start_engine(params: dict[str, Any]) -> Any:
        """`processes` processes under this one, each wanting a CPU all the time."""
        for _ in range(params["processes"]):
            engine.append(subprocess.Popen([sys.executable, "-c", BUSY]))
        return [process.pid for process in engine]

    def stop_engine(params: dict[str, Any]) -> Any:
        for process in engine:
            process.kill()
            process.wait()
        engine.clear()

    def hang(params: dict[str, Any]) -> Any:
        threading.Event().wait()  # never set: an engine stuck waiting

    def hang_hard(params: dict[str, Any]) -> Any:
        while True:
            try:
                threading.Event().wait()
            except Aborted:
                continue

    def wait_on_peer(params: dict[str, Any]) -> Any:
        with server.waiting_on_peer():
            time.sleep(params["seconds"])
        return {"waited": params["seconds"]}

    def fail(params: dict[str, Any]) -> Any:
        raise ValueError(f"bad batch {params.get('batch')}")

    def die(params: dict[str, Any]) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    server = WorkerServer(
        work_endpoint=args["work"],
        control_endpoint=args["control"],
        role=args["role"],
        rank=args["rank"],
        heartbeat_s=args.get("heartbeat_s", 0.1),
        handlers={
            name: as_mapping(handler)
            for name, handler in {
                "echo": echo,
                "work": work,
                "hang": hang,
                "compute": compute,
                "spin": spin,
                "spin_in_c": spin_in_c,
                "start_engine": start_engine,
                "stop_engine": stop_engine,
                "wait_on_peer": wait_on_peer,
                "hang_hard": hang_hard,
                "raise": fail,
                "die": die,
            }.items()
        },
    )
    server.serve()


if __name__ == "__main__":
    main()
