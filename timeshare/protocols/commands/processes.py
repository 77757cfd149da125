"""A worker as the command lanes know it: who it is, and when its process exits.

`WorkerId` is a worker's role and rank, as its hello on each lane says.
`watch_process` reports a worker's exit to the lanes the moment it happens, so that every wait
on that worker ends at once rather than at a deadline.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import anyio

REAPED_S = 5.0  # for another thread's wait on an exited process to return


class ExitListener(Protocol):
    def worker_exited(self, worker: WorkerId, returncode: int, why: str | None = None) -> None: ...


@dataclass(frozen=True)
class WorkerId:
    role: str
    rank: int

    def __str__(self) -> str:
        return f"{self.role} rank {self.rank}"


async def watch_process(
    lanes: ExitListener, worker: WorkerId, process: subprocess.Popen[Any]
) -> int:
    """Report the worker's exit to `lanes` the moment it happens; return its exit code.

    A pidfd becomes readable when the process exits: no polling, no thread.
    """
    pidfd = os.pidfd_open(process.pid)
    try:
        if process.poll() is None:
            await anyio.wait_readable(pidfd)
        returncode = process.poll()  # readable pidfd: the process has exited, this reaps it
    finally:
        os.close(pidfd)
    if returncode is None:
        # Another thread is in `process.wait()` and reaps it (Popen.poll does not wait for its
        # lock): Popen's own bounded wait returns the code once that one has.
        wait = partial(process.wait, timeout=REAPED_S)
        returncode = await anyio.to_thread.run_sync(wait)
    lanes.worker_exited(worker, returncode)
    return returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"signal {-returncode}"
    return f"exit code {returncode}"
