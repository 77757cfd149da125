"""What the tests of an engine we do not own (vLLM, SGLang) share to kill parts of it: the host
process that runs one engine and says what happens (each engine's host.py), a `timeshare run`
in a process of its own, and what the runtime directory's records say of the engine's
processes and shared memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import psutil

from tests.cycle.jobs import RESOURCE_TRACKER
from timeshare.protocols.weights import sweep_stale
from timeshare.runtime import SHM_ROOT as SHM
from timeshare.runtime import mapped_anywhere

ROOT = Path(__file__).resolve().parents[2]
EVENT_TIMEOUT_S = 300.0  # an engine's start-up on a loaded machine, with room


class Host:
    """`python -m <module> RUNTIME_DIR ENDPOINT` (an engine's host.py), and its events."""

    def __init__(self, module: str, runtime_dir: Path) -> None:
        self.endpoint = f"ipc://{runtime_dir}/w-rank0.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(runtime_dir), self.endpoint],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name="host-stdout", daemon=True).start()

    def next_event(self) -> dict[str, Any]:
        """The host's next event within EVENT_TIMEOUT_S (the engine logs to stdout too: its
        lines are skipped)."""
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"host said nothing within {EVENT_TIMEOUT_S:g} s") from None
            assert line, f"host exited with {self.proc.wait(timeout=30)} and said nothing"
            if line.startswith('{"event"'):
                event: dict[str, Any] = json.loads(line)
                return event

    def _read(self) -> None:
        """Every line of the host's stdout into `lines`, then "" at its end."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def assert_nothing_left(runtime_dir: Path) -> None:
    """The engine's shared memory is on record in the runtime dir, and a sweep removes it (what
    the driver does once its workers are gone); then nothing is left there or in /dev/shm."""
    recorded = recorded_segments(runtime_dir)
    sweep_stale(runtime_dir, owners_gone=True)
    assert [name for name in recorded if (Path("/dev/shm") / name).exists()] == []
    assert [p.name for p in runtime_dir.iterdir()] == []


def recorded_processes(runtime_dir: Path) -> list[int]:
    """The engines' processes (their rollout workers included), from their records, once they
    have started: an engine starting has a record of its rollout worker alone (what it starts
    is recorded from the start: engines/foreign.py `starting`), which is left out."""
    found = []
    for record in runtime_dir.glob("*.segments.json"):
        owners = [pid for pid, _ in json.loads(record.read_text())["owners"]]
        found += owners if len(owners) > 1 else []
    return found


def recorded_segments(runtime_dir: Path) -> list[str]:
    """The engines' shared memory, as the records name it."""
    names = []
    for record in runtime_dir.glob("*.segments.json"):
        names += json.loads(record.read_text())["segments"]
    return names


def shm_names() -> set[str]:
    """What /dev/shm holds now."""
    return set(os.listdir(SHM))


def left_in_shm(before: set[str], settle_s: float = 10.0) -> list[str]:
    """What appeared in /dev/shm since `before` and stays there, mapped by no live process:
    what dead processes left behind. make test runs SGLang's tests beside others: their files
    are mapped by their own live processes, or gone within `settle_s`. A leak stays. (So do the
    semaphores of Python's resource tracker for moments after their processes exit.)"""
    deadline = time.monotonic() + settle_s
    while True:
        new = shm_names() - before
        left = sorted(new - mapped_anywhere(new))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def wait_for(what: str, check: Any, timeout_s: float, proc: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if proc.poll() is not None:
            try:  # (a process it left holding its stderr would keep a read waiting)
                _, said = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                said = "(its stderr still open 30 s after it exited)"
            said = (said or "")[-3000:]
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {said}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.01)
    return found


def start_run(root: Path, config: Path) -> subprocess.Popen[str]:
    """`timeshare run config` in a process of its own, its summary in `root`."""
    argv = [sys.executable, "-m", "timeshare", "run", str(config)]
    return subprocess.Popen(
        [*argv, "--summary", str(root / "summary.json")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_pids() -> set[int]:
    """The live processes under this one, but Python's resource tracker."""
    live = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE and RESOURCE_TRACKER not in " ".join(
                child.cmdline()
            ):
                live.add(child.pid)
    return live


def stop_resource_tracker_when_alone() -> None:
    """Stop the resource tracker that starting an engine (spawn) started in this test process,
    once nothing else runs under it: left running, it would fail later tests' check that they
    leave no process. While another engine of this process still runs (another module's shared
    one), its processes hold the tracker's pipe and stopping would wait for them: it stays."""
    if not child_pids():
        resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


def tp_1_and_tp_2_runs(
    root: Path, config_of: Callable[[Path, int], Path]
) -> dict[int, list[dict[str, Any]]]:
    """The same job (`config_of(directory, tensor_parallel)`) run with an engine per rank and
    with one engine of two TP workers for both ranks: each run's steps, checked to agree step
    by step (the same weights bit for bit, every TP worker's included; logprobs within fp32
    noise of the trainer's; the same rewards), each TP worker having loaded every byte sent."""
    from tests.cycle.jobs import assert_nothing_left
    from tests.daemon.test_run import steps_of, timeshare_run

    before = shm_names()
    runs = {}
    for tp in (1, 2):
        directory = root / f"tp{tp}"
        directory.mkdir()
        summary = directory / "summary.json"
        done = timeshare_run(config_of(directory, tp), summary, timeout_s=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[tp] = steps_of(summary)
        assert_nothing_left(directory)
    assert left_in_shm(before) == []  # nor anything the records did not name
    for tp, steps in runs.items():
        assert [s["step"] for s in steps] == [1, 2, 3], tp
        assert all(s["weights_match"] and s["ranks_agree"] for s in steps), tp
        assert all(s["logprob_max_abs_diff"] < 1e-4 for s in steps), tp
    one, two = runs[1], runs[2]
    assert [s["weights_digest"] for s in one] == [s["weights_digest"] for s in two]
    assert [s["reward_mean"] for s in one] == [s["reward_mean"] for s in two]
    for step in two:  # one engine, sent to once, by rank 0; each TP worker loaded all of it
        sent = step["per_rank"][0]["sent_bytes"]
        assert sent > 0 and step["sync"]["bytes"] == sent
        assert step["per_rank"][0]["loaded_bytes"] == [sent, sent]
        assert (step["per_rank"][1]["sent_bytes"], step["per_rank"][1]["loaded_bytes"]) == (0, [])
    return runs


def refused_before_any_process(config: Path, root: Path, *said: str) -> None:
    """`timeshare run config` is exit 2 saying each of `said`, with no process started (no
    runtime directory made)."""
    from tests.daemon.test_run import timeshare_run

    done = timeshare_run(config, root / "summary.json", timeout_s=200)
    assert done.returncode == 2, done.stderr
    assert all(part in done.stderr for part in said), done.stderr
    assert not (root / "run").exists()
