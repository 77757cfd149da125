"""SGLang's shutdown ends the engine's own processes, not every process its host started.

SGLang's `Engine.shutdown` ends with `kill_process_tree(os.getpid(), include_parent=False)`: a
SIGKILL to every descendant of the process that hosts the engine. In a rollout worker that
includes Python's resource tracker, which must outlive SGLang's processes to unlink the named
semaphores they shared (/dev/shm/sem.mp-*): killed with them, it leaves those in /dev/shm for
good. In a process that hosts two engines (the contract tests' shared ones) it includes the
other engine, whose watchdog then fails it.

`OWN_PROCESSES_ONLY` narrows that one call, in the process that hosts the engine: it kills the
processes of the engine shutting down (`ending`, in the thread that shuts it down), or with none
named (SGLang's own shutdown at interpreter exit, of an engine never closed) the host's
descendants; never a resource tracker. SGLang's other calls of it (a
process that fails, killing itself and its tree) are left as they are. It changes what SGLang
does, so it is a patch (engines/patches.py), written for the SGLang versions in `known`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator

from timeshare.engines.patches import Patch
from timeshare.errors import TimeshareError
from timeshare.runtime import is_resource_tracker, parent_of, process_tree, reap, wait_gone

ENGINE_MODULE = "sglang.srt.entrypoints.engine"  # whose `kill_process_tree` shutdown calls


class _Ending(threading.local):
    """The processes of the engines shutting down in this thread (`ending`), innermost last."""

    def __init__(self) -> None:
        self.stack: list[list[int]] = []


_ending = _Ending()


@contextlib.contextmanager
def ending(processes: list[int]) -> Iterator[None]:
    """While an engine shuts down: SGLang's kill of its host's tree kills `processes` alone."""
    _ending.stack.append(processes)
    try:
        yield
    finally:
        _ending.stack.pop()


def kill_own(skip_pid: int | None, timeout_s: float | None) -> None:
    """SIGKILL the processes of the engine ending (else every descendant of this process), not
    a resource tracker nor `skip_pid`; wait up to `timeout_s` for them to exit (this process's
    children reaped)."""
    me = os.getpid()
    named = _ending.stack[-1] if _ending.stack else process_tree(me)[1:]
    doomed = [pid for pid in named if pid != skip_pid and not is_resource_tracker(pid)]
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if timeout_s is None:
        return
    deadline = time.monotonic() + timeout_s
    children = [pid for pid in doomed if parent_of(pid) == me]
    left = reap(children, timeout_s)
    left += wait_gone([p for p in doomed if p not in children], deadline - time.monotonic())
    if left:
        raise TimeshareError(f"SGLang's processes {sorted(left)} outlived SIGKILL")


def narrow(module: types.ModuleType) -> None:
    """Replace `module`'s `kill_process_tree` (SGLang's signature) by one that, asked to kill
    this process's descendants, kills those of the engine ending alone (`kill_own`)."""
    original: Callable[..., None] = module.kill_process_tree

    def kill_process_tree(
        parent_pid: int | None,
        include_parent: bool = True,
        skip_pid: int | None = None,
        wait_timeout: float | None = 60,
    ) -> None:
        if include_parent or parent_pid not in (None, os.getpid()):
            original(parent_pid, include_parent, skip_pid, wait_timeout)
            return
        kill_own(skip_pid, wait_timeout)

    vars(module)["kill_process_tree"] = kill_process_tree  # (the name shutdown looks up)


OWN_PROCESSES_ONLY = Patch(
    name="sglang.own_processes_only",
    version_of="sglang",
    known=frozenset({"0.5.23"}),
    apply=lambda: narrow(importlib.import_module(ENGINE_MODULE)),
    why="SGLang's shutdown SIGKILLs every child of its host: its resource tracker, other engines",
)
