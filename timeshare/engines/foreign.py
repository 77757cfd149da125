"""Driving an inference engine we do not own from the rollout worker: every call bounded by a
deadline, and the processes it starts marked as ours. `ForeignRollout` is what vLLM's and
SGLang's rollout engines share on top of these.

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
import getpass
import os
import re
import shutil
import tempfile
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import ClassVar, TypeVar

from timeshare.engines.base import RolloutEngine
from timeshare.engines.load_report import LoadReport
from timeshare.errors import EngineBroken, TimeshareError
from timeshare.protocols.commands.results import WorkerLoad
from timeshare.runtime import (
    children_of,
    foreign_temp_dir,
    is_resource_tracker,
    mapped_segments,
    parent_of,
    process_tree,
    reap,
    record_foreign_segments,
    release_foreign_segments,
    running_since,
)

T = TypeVar("T")
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_HEADERS = "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"


class CallTimedOut(Exception):
    """`bounded`'s call did not return within its deadline (it may still be running)."""


def bounded(what: str, fn: Callable[[], T], timeout_s: float) -> T:
    """`fn()` within `timeout_s`, or `CallTimedOut`; what it raised, raised here."""
    outcome: list[T] = []
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
    return outcome[0]


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


def compile_caches(environ: Mapping[str, str]) -> dict[str, str]:
    """How torch's compiler keeps what it builds, for an engine whose processes get a TMPDIR
    of their own (`ForeignRollout.starting`), where the user did not say otherwise:

    - its cache where it would be without that TMPDIR (its default lies in the temporary
      directory): left to follow TMPDIR, every engine start compiled its C++ kernels again,
      into a directory removed with the engine;
    - no precompiled header for its C++ kernels: each new process preprocesses that header
      before it looks in the cache (torch._inductor.codecache `_precompile_header`), 4 to 5 s
      of g++ at every start of vLLM's CPU engine here, cached kernel or not. It concerns the
      C++ kernels of CPU devices only (a GPU's are Triton's).
    """
    wanted = {INDUCTOR_CACHE: _default_inductor_cache(), INDUCTOR_HEADERS: "0"}
    return {key: value for key, value in wanted.items() if key not in environ}


def _default_inductor_cache() -> str:
    try:  # torch's own rule (private: its fallback below is what it says today)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415

        return str(default_cache_dir())
    except ImportError:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


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


REAP_S = 10.0  # for an engine's processes to exit once it was shut down
RELEASED = frozenset({"weights", "kv_cache"})  # the memory tags that OFFLOAD releases


class ForeignRollout(RolloutEngine):
    """A rollout engine whose model lives in processes the engine starts itself (vLLM's
    EngineCore and workers, SGLang's schedulers): each call into it is bounded, and past its
    deadline the engine is broken for good; a call that fails because one of its processes
    died names that process; its processes and the shared memory they map are recorded for
    the runtime directory's sweep (a SIGKILL leaves nothing behind), and `close` reaps them
    whatever state the engine is in.

    An engine says its name and its processes' title prefix, how it shuts down, whether its
    sleep frees memory on this platform (`releases`) and what it holds (`_mb`)."""

    name: ClassVar[str]  # as errors name it: "vLLM", "SGLang"
    title_prefix: ClassVar[str]  # its processes' titles: "VLLM::", "sglang::"
    segment_prefixes: ClassVar[tuple[str, ...]]  # the /dev/shm names its processes map

    def __init__(
        self,
        rank: int,
        runtime_dir: Path,
        call_timeout_s: float,
        generate_timeout_s: float,
        *,
        releases: bool,
    ) -> None:
        super().__init__(generate_timeout_s)
        self.rank = rank
        self.runtime_dir = runtime_dir
        self.owner = f"{self.name.lower()}-rank{rank}"  # of its segments, in the runtime dir
        self.call_timeout_s = call_timeout_s
        self.releases = releases  # whether sleep frees memory here (CUDA) or only pauses
        self.broken: str | None = None  # why the engine can no longer be used
        self.digest_of_version = ""
        self.weights_bytes = 0
        self.asleep: set[str] = set()
        self._scratch: Path | None = None  # a directory of its own (a config-only model, ...)
        self._started: list[tuple[int, int | None]] = []  # what its start made this process
        # start: pid and start time (a pid reused later is not its)
        self._children: list[int] = []  # its processes this one started, alive at record time
        self._titles: dict[int, str] = {}  # all its processes: pid -> title
        self._orphans: list[str] = []  # segments its start-up left that nobody maps
        self.temp: Path | None = None  # its processes' temporary directory (`starting`)

    @property
    def who(self) -> str:
        return f"{self.name} rollout rank {self.rank}"

    @abstractmethod
    def shutdown_engine(self) -> None:
        """The engine's own shutdown (its processes exit; `close` reaps them)."""

    @abstractmethod
    def _mb(self) -> float:
        """Weights and KV cache the engine holds while awake, in MiB."""

    # -- calls ----------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """`fn` (a call into the engine) within the deadline; past it, the engine is broken."""
        self.check_usable()
        bound = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            return bounded(f"{self.name.lower()}-{what}", fn, bound)
        except CallTimedOut as exc:
            self.broken = str(exc)
            raise EngineBroken(f"{self.who}: {self.broken}") from exc
        except EngineBroken:
            raise  # said already (SGLang's SIGQUIT handler names the process that failed)
        except Exception as exc:
            self.raise_if_process_gone(what, exc)
            raise

    def raise_if_process_gone(self, what: str, exc: Exception) -> None:
        """A call that failed because one of the engine's processes died (a TP worker killed)
        is `EngineBroken` naming that process; the engine's own error says only that it is
        dead. (Once one died the engine shuts the others down: all of them may be named.)"""
        gone = exited(self._titles)
        if gone:
            self.broken = f"{', '.join(gone)} exited"
            raise EngineBroken(
                f"{self.who}: {what} failed, {self.broken}: {type(exc).__name__}: {exc}"
            ) from exc

    def check_usable(self) -> None:
        if self.broken is not None:
            raise EngineBroken(f"{self.who} is unusable: {self.broken}")

    def digest(self) -> str:
        """What arrived at the engine's loader for the last whole version."""
        if self.torn or not self.digest_of_version:
            raise TimeshareError("digest: no whole weight version has been loaded")
        return self.digest_of_version

    def table(self) -> dict[str, str]:
        """The per-tensor lines of what arrived at the loader (TP worker 0's, as `digest`)."""
        self.digest()  # (a torn version has none)
        return self.worker_tables.get(0, {})

    def loaded(self, reports: Sequence[LoadReport]) -> LoadReport:
        """The engine's TP workers' reports of a whole version (checked, in TP-rank order):
        kept, each worker's own, since each was sent every tensor and hashed what reached its
        loader (every digest must be the trainer's: state/weights.py). Worker 0's is the
        engine's. Returns it."""
        received = reports[0]
        self.digest_of_version = received.digest
        self.weights_bytes = received.transfer.bytes
        self.worker_loads = [
            WorkerLoad(report.worker, report.transfer.bytes, report.digest) for report in reports
        ]
        self.worker_tables = {report.worker: report.tensors for report in reports}
        return received

    # -- memory ---------------------------------------------------------------------------------

    def held_mb(self) -> float:
        """What sleep could release and still holds (0 where it can release nothing)."""
        if not self.releases or self.asleep >= RELEASED:
            return 0.0
        return self._mb()

    def resident_mb(self) -> float:
        """Weights and KV cache that stay in memory because the platform cannot free them."""
        return 0.0 if self.releases else self._mb()

    # -- processes ------------------------------------------------------------------------------

    def scratch(self) -> Path:
        """This engine's own temporary directory, made on first use, removed by `close`; inside
        a `foreign_temp_dir` naming this process, so that a later run's sweep removes it
        should this process be killed before `close` (the directory itself holds only what
        the engine puts there: a model directory's files, read by the engine)."""
        if self._scratch is None:
            scratch = foreign_temp_dir(f"{self.owner}-scratch") / "scratch"
            scratch.mkdir()
            self._scratch = scratch
        return self._scratch

    @contextlib.contextmanager
    def starting(self, host_pid_env: str, extra: dict[str, str]) -> Iterator[None]:
        """While the engine starts its processes: this process's pid as `host_pid_env` and
        `extra` in their environment (host_pid_in_environment), and a temporary directory of
        their own (TMPDIR; this process's `tempfile` too, where the engine names its ipc
        sockets), recorded from now on: the record's release or sweep removes it and what
        libzmq and others leave there, however the processes end."""
        caches = compile_caches(os.environ)  # (where they are without the TMPDIR below)
        self.temp = temp = foreign_temp_dir(self.owner)
        record_foreign_segments(self.runtime_dir, self.owner, [os.getpid()], [], temp)
        before = tempfile.tempdir
        tempfile.tempdir = str(temp)
        children = set(children_of(os.getpid()))
        try:
            with host_pid_in_environment(host_pid_env, {**extra, **caches, "TMPDIR": str(temp)}):
                yield
            # Its processes: what this process started meanwhile, but Python's resource
            # tracker (one per process, serving whatever it starts; it must outlive them).
            self._started = [
                (pid, running_since(pid))
                for pid in children_of(os.getpid())
                if pid not in children and not is_resource_tracker(pid)
            ]
        except BaseException:
            # a start that failed: its record and its directory go now, not at a later sweep
            release_foreign_segments(self.runtime_dir, self.owner)
            raise
        finally:
            tempfile.tempdir = before

    def record_processes(self) -> None:
        """Record the engine's processes and the shared memory they map, so that a sweep of
        the runtime directory removes it once they are gone, even if SIGKILL ended them."""
        me = os.getpid()
        own = self.own_processes()
        tree = [me, *own]
        self._titles = process_titles(own, self.title_prefix)
        self._children = [pid for pid in own if parent_of(pid) == me]
        names = [
            name
            for pid in tree
            for prefix in self.segment_prefixes
            for name in mapped_segments(pid, prefix)
        ]
        record_foreign_segments(
            self.runtime_dir, self.owner, tree, names + self._orphans, self.temp
        )

    def own_processes(self) -> list[int]:
        """The engine's processes alive now: those its start made this process start, and
        theirs. Not this process's other children: another engine's, its resource tracker."""
        return [
            pid
            for child, start in self._started
            if start is not None and running_since(child) == start
            for pid in process_tree(child)
            if running_since(pid) is not None
        ]

    def close(self) -> None:
        try:
            self.shutdown_engine()
        finally:
            # (an engine may kill a process slow to exit without reaping it: no zombie stays)
            reap(self._children, REAP_S)
            release_foreign_segments(self.runtime_dir, self.owner)
            self.remove_scratch()

    def remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch.parent, ignore_errors=True)
            self._scratch = None
