"""Driving an inference engine we do not own from the rollout worker: every call bounded by a
deadline, and the processes it starts marked as ours.

Both vLLM and SGLang run their own processes and answer calls that can block without an end.
`bounded` runs one such call in a thread and gives up after its deadline (the engine is then
unusable: its caller says so). `host_pid_in_environment` names the rollout worker in the
environment of the processes the engine starts meanwhile (they inherit it): their plugins read
it to arm the parent-death signal and apply timeshare's patches there, and only there.
`process_titles` and `exited` say which of the engine's processes died, when a call fails
because one did (a tensor-parallel worker killed): the engine's own error says only that it is
dead.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from timeshare.runtime import running_since

T = TypeVar("T")


class CallTimedOut(Exception):
    """`bounded`'s call did not return within its deadline (it may still be running)."""


def bounded(what: str, fn: Callable[[], T], timeout_s: float) -> T:
    """`fn()` within `timeout_s`, or `CallTimedOut`; what it raised, raised here."""
    outcome: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimedOut(f"{what} did not return within {timeout_s:g} s")
    if failure:
        raise failure[0]
    result: T = outcome[0]
    return result


@contextlib.contextmanager
def host_pid_in_environment(name: str, extra: dict[str, str] | None = None) -> Iterator[None]:
    """This process's pid as `name` in the environment while the block runs, with `extra`
    (settings the engine's processes read as they start), and only then: other children of
    this process are not the engine's."""
    values = {**(extra or {}), name: str(os.getpid())}
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def process_titles(pids: Iterable[int], prefix: str) -> dict[int, str]:
    """The titles an engine gave its processes (vLLM's `VLLM::Worker_TP1`, SGLang's
    `sglang::scheduler_TP1`): those of `pids` that start with `prefix`, by pid."""
    titles = {}
    for pid in pids:
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        title = words[0].decode(errors="replace") if words else ""
        if title.startswith(prefix):
            titles[pid] = title
    return titles


def exited(titles: dict[int, str]) -> list[str]:
    """Which of an engine's processes have exited, named as errors name them: a
    tensor-parallel worker by its TP rank ("TP worker 1 (VLLM::Worker_TP1, pid 123)")."""
    gone = []
    for pid, title in titles.items():
        if running_since(pid) is None:
            worker = re.search(r"_TP(\d+)(?!\d)", title)
            named = f"TP worker {worker.group(1)} ({title}" if worker else f"{title} ("
            gone.append(f"{named}, pid {pid})")
    return gone
