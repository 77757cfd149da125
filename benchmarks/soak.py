"""Soak: does a long job grow? Memory, descriptors, threads, shared memory, disk, step time.

    python benchmarks/soak.py --json runs/soak.json             (make soak: everything below)
    python benchmarks/soak.py --front run --engine simulated --steps 300 --sample-s 0.2

Each engine's job runs under each front, one after the other, each in a fresh directory under
/tmp (short: the unix sockets' paths must stay under 107 bytes):

  simulated   examples/simulated.toml, 4,000 steps, sampled every 0.2 s (real processes,
              channel and barriers, no model: 50-80 steps a second on 2 cores, so that
              per-step costs add up fast)
  torch_ref   examples/tiny-grpo.toml, 500 steps, sampled every 0.5 s (the main GRPO job,
              about 0.6 s a step)

  run         `timeshare run CONFIG --summary PATH`, to its last step and exit
  daemon      `timeshared` (`python -m timeshare.daemon --config CONFIG`, as the tests start it);
              `timesharectl status` once it answers, polled until the job is done and the
              service idle, then `timesharectl stop`

The job's steps, runtime, checkpoint and state directories, log file and trace are set through
TIMESHARE_* variables; the log file and the trace are on, so that their growth is measured
(--log-max-mb sets [log] max_mb, to see them rotate within a soak). torch's flight recorder
is made small (FLIGHT_RECORDER_ENTRIES) so that its bounded ring fills within the warm-up.

Every --sample-s seconds the sampler reads, for the front and all its descendants
(psutil children(recursive=True)): RSS, VmHWM, open descriptors, threads and CPU time; the
staging segments in /dev/shm of this job's runtime directory (SEGMENT_PREFIX and its staging
tag); the bytes under each area the job writes to (runtime, checkpoints, daemon state, log,
trace, summary, console output); the step reached (the summary's lines, or the daemon's
status); the machine's load. A process is named by its role: front, zygote (`ts-zygote`),
trainer-R and rollout-R (the names the zygote gives its forks; a worker started as
`-m timeshare.engines.worker SPEC` by its spec's role).

Fits use the samples after the warm-up (the first 20% of steps) and before the last step (the
job then tears down), cut into 10 blocks, and give growth per 1,000 steps by least squares
against the step. A level (RSS, descriptors, threads, segments, bytes) is fitted by each
block's floor, its least value: what a process holds moves with the phase it is sampled in
(a rollout engine asleep holds no KV cache), tens of MiB against a target of 1 MiB, while the
floor is the same state each time and a leak raises it too; the fit to every sample is shown
beside it. CPU per step is each block's CPU time over its steps. The step time (from the
summary, or the daemon's journal `step.done` entries) is fitted by each block's median.

Targets (issue 28), PASS/FAIL per run (n/a: too few samples to fit):

  rss           no process's RSS floor grows by 1 MiB per 1,000 steps
  fds           no process gains a descriptor per 1,000 steps (fitted slope < 1)
  threads       no process gains a thread per 1,000 steps
  shm           staging segments: neither their count nor their bytes grow
  disk          runtime, checkpoints: flat (< 64 KiB per 1,000 steps); what rotates (the
                daemon's journal; the log and the trace, if [log] max_mb > 0) within its
                configured bound; the summary and the console output grow a line per step by
                design and are reported only
  step time     its growth under 10% of the median step time per 1,000 steps
  cpu per step  the same for the CPU the whole job spends per step: the step time's trend
                without the rest of this shared machine's work in it
  clean exit    the front exited 0 and left no process, staging segment or socket behind

Every process started is stopped on every path: the front gets SIGTERM, then its process group
SIGKILL; every descendant ever seen is killed by pid if it outlived it; the runtime directory
is swept as the daemon's next start would. Every wait has a deadline. Exit status 1 if any
target failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from timeshare.config import load_config
from timeshare.cycle.workers import prepare_runtime
from timeshare.daemon.records import JOURNAL_MAX_BYTES, read_journal
from timeshare.protocols.weights.segments import SEGMENT_PREFIX, staging_tag
from timeshare.report.summary import read_summary
from timeshare.runtime import SHM_ROOT

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
KIB = 1 << 10
PER = 1000  # growth is reported per this many steps

# Targets (issue 28), per 1,000 steps.
RSS_MAX_MIB = 1.0
FDS_MAX = 1.0
THREADS_MAX = 1.0
SHM_SEGMENTS_MAX = 0.5
SHM_MAX_MIB = 1.0
DISK_FLAT_MAX_MIB = 64 * KIB / MIB
STEP_TIME_MAX = 0.10  # of the median step time
WARMUP = 0.2  # of the steps: allocators, caches and the first checkpoints settle
BLOCKS = 10  # a fit's points: the floor (or median) of each of this many runs of samples
PER_BLOCK = 5  # samples a block needs at least

# Deadlines: nothing here waits without one.
START_S = 240.0  # to the first step (workers forked, engines built, a cold page cache)
STALL_S = 180.0  # no new step this long: the job is hung
STOP_S = 150.0  # a front's drain ([daemon] drain_s is 120 s by default) and exit
REAP_S = 10.0  # for processes killed to be gone
CTL_S = 60.0  # one timesharectl command


@dataclass(frozen=True)
class Engine:
    name: str
    config: Path
    steps: int  # the default soak
    sample_s: float  # the default time between samples: about a step, or more samples a step
    step_budget_s: float  # a run slower than this per step on average is declared hung


ENGINES = {
    "simulated": Engine("simulated", REPO / "examples" / "simulated.toml", 4000, 0.2, 2.0),
    "torch_ref": Engine("torch_ref", REPO / "examples" / "tiny-grpo.toml", 500, 0.5, 6.0),
}
FRONTS = ("run", "daemon")


@dataclass(frozen=True)
class Layout:
    """Where one run keeps everything: a fresh, short directory under /tmp."""

    root: Path

    @property
    def runtime(self) -> Path:
        return self.root / "rt"

    @property
    def checkpoints(self) -> Path:
        return self.root / "ck"

    @property
    def state(self) -> Path:
        return self.root / "st"

    @property
    def log(self) -> Path:
        return self.root / "logs" / "log.jsonl"

    @property
    def trace(self) -> Path:
        return self.root / "logs" / "trace.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.jsonl"

    @property
    def output(self) -> Path:
        return self.root / "front.out"


# torch's flight recorder keeps each process's last collectives (TORCH_FR_BUFFER_SIZE, 2,000 by
# default, ~1 KiB each): a trainer's RSS rises ~1 KiB an all-reduce until the ring is full, ~2
# MiB, then stays (a two-process gloo loop: flat from the start with the ring off). Fitted over
# 1,000 steps of a few all-reduces each, that filling ring reads as growth of ~3 MiB per 1,000
# steps; a ring this small is full within the warm-up, and what is left to fit is growth that
# no ring bounds. A TORCH_FR_BUFFER_SIZE of the caller's own wins.
FLIGHT_RECORDER_ENTRIES = 64


def job_env(layout: Layout, steps: int, front: str, log_max_mb: float | None) -> dict[str, str]:
    """The TIMESHARE_* overrides of one run (the example's file says everything else), and
    the flight recorder's size."""
    env = {
        "TIMESHARE_JOB__STEPS": str(steps),
        "TIMESHARE_JOB__RUNTIME_DIR": str(layout.runtime),
        "TIMESHARE_JOB__CHECKPOINT_DIR": str(layout.checkpoints),
        "TIMESHARE_LOG__FILE": str(layout.log),
        "TIMESHARE_LOG__TRACE": str(layout.trace),
    }
    if log_max_mb is not None:
        env["TIMESHARE_LOG__MAX_MB"] = str(log_max_mb)
    if "TORCH_FR_BUFFER_SIZE" not in os.environ:
        env["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    if front == "daemon":
        env["TIMESHARE_DAEMON__STATE_DIR"] = str(layout.state)
        env["TIMESHARE_DAEMON__METRICS_PORT"] = "0"  # any free port: never another's
    return env


# -- the fronts ------------------------------------------------------------------------------


class LineCounter:
    """Whole lines a file has so far, read incrementally: a sample costs the new bytes only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines = 0

    def count(self) -> int:
        try:
            with self.path.open("rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return 0
        whole = data.rfind(b"\n") + 1  # a line being written is counted once it ends
        self.lines += data.count(b"\n", 0, whole)
        self.offset += whole
        return self.lines


class Front:
    """One job's front process: how it starts, how far its job is, how it ends."""

    def __init__(self, engine: Engine, layout: Layout, steps: int, env: dict[str, str]) -> None:
        self.engine = engine
        self.layout = layout
        self.steps = steps
        self.env = {**os.environ, **env}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def job_runtime(self) -> Path:
        """The directory of the job's worker sockets, workers.json and staging tag."""
        return self.layout.runtime

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        self.layout.output.parent.mkdir(parents=True, exist_ok=True)
        with self.layout.output.open("wb") as sink:
            # Its own session: on any failure its whole process group is killed at once.
            self.process = subprocess.Popen(
                self.argv(),
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.layout.root,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def step(self) -> int:
        """The last step the job finished."""
        raise NotImplementedError

    def done(self) -> bool:
        """Whether the job ran all its steps (or its front gave up)."""
        raise NotImplementedError

    def finish(self) -> int:
        """End the front the way an operator would; its exit code."""
        raise NotImplementedError

    def step_times(self) -> dict[int, float]:
        """Every finished step's time (TRAIN's start to ROLLOUT's end), by step."""
        raise NotImplementedError

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)


class RunFront(Front):
    """`timeshare run CONFIG --summary PATH`: runs its steps and exits."""

    def __init__(self, engine: Engine, layout: Layout, steps: int, env: dict[str, str]) -> None:
        super().__init__(engine, layout, steps, env)
        self.lines = LineCounter(layout.summary)

    def argv(self) -> list[str]:
        config, summary = str(self.engine.config), str(self.layout.summary)
        return [sys.executable, "-m", "timeshare", "run", config, "--summary", summary]

    def step(self) -> int:
        return max(0, self.lines.count() - 1)  # the first line is the header

    def done(self) -> bool:
        return not self.alive()

    def finish(self) -> int:
        return self.wait(STOP_S)

    def step_times(self) -> dict[int, float]:
        return {s["step"]: s["step_s"] for s in read_summary(self.layout.summary).steps}


class DaemonFront(Front):
    """`timeshared`, started as tests/daemon/daemons.py starts it, operated with timesharectl."""

    def __init__(self, engine: Engine, layout: Layout, steps: int, env: dict[str, str]) -> None:
        super().__init__(engine, layout, steps, env)
        self.socket = layout.runtime / "control.sock"
        self.status: dict[str, Any] = {}

    @property
    def job_runtime(self) -> Path:
        return self.layout.runtime / "job"  # daemon/main.py `resolve`

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "timeshare.daemon", "--config", str(self.engine.config)]

    def start(self) -> None:
        super().start()
        deadline = time.monotonic() + START_S
        while not self._poll_status():
            if not self.alive():
                raise RuntimeError(f"timeshared exited: {tail(self.layout.output)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the control socket did not answer in {START_S:.0f} s")
            time.sleep(0.1)
        self.ctl("status")  # what an operator would see first

    def ctl(self, *args: str) -> str:
        argv = [sys.executable, "-m", "timeshare.daemon.ctl", "--socket", str(self.socket)]
        done = subprocess.run(
            [*argv, *args], capture_output=True, text=True, timeout=CTL_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"timesharectl {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def _poll_status(self) -> bool:
        """Ask the daemon its status on a fresh connection (cheaper than a timesharectl
        process per sample); False where it did not answer."""
        request = {"id": 1, "method": "status", "params": {}}
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(10.0)
                client.connect(str(self.socket))
                client.sendall(json.dumps(request).encode() + b"\n")
                reply = json.loads(client.makefile("rb").readline())
        except (OSError, ValueError):
            return False
        self.status = reply.get("result") or {}
        return bool(self.status)

    def step(self) -> int:
        self._poll_status()
        last = self.status.get("last_step") or {}
        return int(last.get("step", 0))

    def done(self) -> bool:
        lifecycle = self.status.get("lifecycle")
        if lifecycle == "failed" or not self.alive():
            return True
        return lifecycle == "idle" and self.step() >= self.steps

    def finish(self) -> int:
        if self.status.get("lifecycle") == "failed":
            raise RuntimeError(f"the daemon failed: {self.status.get('reason')}")
        self.ctl("stop")
        return self.wait(STOP_S)

    def step_times(self) -> dict[int, float]:
        entries = read_journal(self.layout.state)
        return {e["step"]: e["figures"]["step_s"] for e in entries if e.get("kind") == "step.done"}


def tail(path: Path, size: int = 3000) -> str:
    with suppress(OSError):
        return path.read_text(errors="replace")[-size:]
    return ""


# -- sampling --------------------------------------------------------------------------------


@dataclass
class ProcessSample:
    pid: int
    label: str  # front, zygote, trainer-0, rollout-1, ...
    role: str  # front, zygote, trainer, rollout, other
    rss: int
    peak: int  # VmHWM: the most RSS it ever had
    fds: int
    threads: int
    cpu_s: float  # user and system, since it started


@dataclass
class Sample:
    t: float  # seconds since the front started
    step: int
    processes: list[ProcessSample]
    shm_segments: int
    shm_bytes: int
    disk: dict[str, int]  # bytes, per area
    load: float  # the machine's 1-minute load average: how much else ran (it is shared)


def classify(process: psutil.Process, front_pid: int) -> tuple[str, str]:
    """(role, label) of one process of the job."""
    if process.pid == front_pid:
        return "front", "front"
    name = process.name()
    if name == "ts-zygote":
        return "zygote", "zygote"
    for role in ("trainer", "rollout"):
        if name.startswith(f"ts-{role}-"):  # the zygote names its forks (cycle/zygote.py)
            return role, name.removeprefix("ts-")
    return classify_by_command(process.cmdline(), name)


def classify_by_command(argv: list[str], name: str) -> tuple[str, str]:
    """A process not named by the zygote: by its command line."""
    if "timeshare.cycle.zygote" in argv:
        return "zygote", "zygote"
    if "timeshare.engines.worker" in argv:
        with suppress(IndexError, ValueError, KeyError, TypeError):
            spec = json.loads(argv[argv.index("timeshare.engines.worker") + 1])
            return str(spec["role"]), f"{spec['role']}-{spec.get('rank', '?')}"
    return "other", f"other:{name}"


def sample_processes(front: psutil.Process, seen: dict[int, psutil.Process]) -> list[ProcessSample]:
    """The front and every descendant now; each one is remembered in `seen`, to be reaped."""
    try:
        tree = [front, *front.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    samples = []
    for process in tree:
        seen.setdefault(process.pid, process)
        with suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            role, label = classify(process, front.pid)
            with process.oneshot():
                rss = process.memory_info().rss
                threads = process.num_threads()
                times = process.cpu_times()
            fds, peak = process.num_fds(), peak_rss(process.pid)
            cpu_s = times.user + times.system
            samples.append(ProcessSample(process.pid, label, role, rss, peak, fds, threads, cpu_s))
    return samples


def peak_rss(pid: int) -> int:
    """The process's high-water RSS (VmHWM in /proc/PID/status, kB), 0 if it is gone."""
    with suppress(OSError), open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    return 0


def shm_usage(tag: str) -> tuple[int, int]:
    """How many staging segments this job's runtime directory has, and their bytes."""
    count = size = 0
    for path in SHM_ROOT.glob(f"{SEGMENT_PREFIX}{tag}-*"):
        with suppress(FileNotFoundError):
            size += path.stat().st_size
            count += 1
    return count, size


def tree_bytes(paths: Iterable[Path]) -> int:
    """Bytes of the regular files at or under `paths` (files come and go as it walks)."""
    total = 0
    for path in paths:
        if path.is_file():
            with suppress(FileNotFoundError):
                total += path.stat().st_size
            continue
        for directory, _, names in os.walk(path):
            for name in names:
                with suppress(FileNotFoundError):
                    status = os.lstat(os.path.join(directory, name))
                    total += status.st_size if stat.S_ISREG(status.st_mode) else 0  # no sockets
    return total


def generations(path: Path) -> list[Path]:
    """A rotated file and its generations (path.1, path.2, ...)."""
    return [path, *path.parent.glob(f"{path.name}.*")]


def disk_usage(front: Front) -> dict[str, int]:
    layout = front.layout
    areas = {
        "runtime": [layout.runtime],
        "checkpoints": [layout.checkpoints],
        "log": generations(layout.log),
        "trace": generations(layout.trace),
        "output": [layout.output],
    }
    if isinstance(front, DaemonFront):
        areas["state"] = [layout.state]
    else:
        areas["summary"] = [layout.summary]
    return {area: tree_bytes(paths) for area, paths in areas.items()}


def take_sample(
    front: Front, root: psutil.Process, seen: dict[int, psutil.Process], started: float
) -> Sample:
    step = front.step()
    processes = sample_processes(root, seen)
    segments, shm_bytes = shm_usage(staging_tag(front.job_runtime))
    t = time.monotonic() - started
    return Sample(t, step, processes, segments, shm_bytes, disk_usage(front), os.getloadavg()[0])


def watch(front: Front, sample_s: float, seen: dict[int, psutil.Process]) -> list[Sample]:
    """Sample the job every `sample_s` until it is done; a hung or slow job raises."""
    assert front.process is not None
    root = psutil.Process(front.process.pid)
    started = time.monotonic()
    deadline = started + START_S + front.steps * front.engine.step_budget_s
    samples: list[Sample] = []
    last_step, moved = -1, started
    while True:
        sample = take_sample(front, root, seen, started)
        samples.append(sample)
        now = time.monotonic()
        if sample.step != last_step:
            last_step, moved = sample.step, now
        if front.done():
            return samples
        if now > deadline:
            raise TimeoutError(f"step {sample.step} of {front.steps} after {now - started:.0f} s")
        if now - moved > (STALL_S if last_step > 0 else START_S):
            raise TimeoutError(f"no step past {sample.step} in {now - moved:.0f} s")
        time.sleep(max(0.0, sample_s - (time.monotonic() - now)))


# -- stopping everything ---------------------------------------------------------------------


@dataclass
class Leftovers:
    processes: list[str] = field(default_factory=list)
    segments: int = 0
    sockets: list[str] = field(default_factory=list)

    def none(self) -> bool:
        return not (self.processes or self.segments or self.sockets)


def still_running(seen: dict[int, psutil.Process]) -> list[psutil.Process]:
    """The processes seen that are still there (a zombie is gone: only its entry remains)."""
    alive = []
    for process in seen.values():
        with suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive


def left_behind(front: Front, seen: dict[int, psutil.Process]) -> Leftovers:
    """What the front left once it exited: processes (given REAP_S to go), segments, sockets."""
    deadline = time.monotonic() + REAP_S
    while still_running(seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    processes = []
    for process in still_running(seen):
        with suppress(psutil.NoSuchProcess):
            processes.append(f"{process.pid} {process.name()}")
    segments, _ = shm_usage(staging_tag(front.job_runtime))
    runtime = front.layout.runtime
    sockets = [str(p) for p in runtime.rglob("*") if p.is_socket() or p.name == "workers.json"]
    return Leftovers(processes, segments, sockets)


def reap(front: Front, seen: dict[int, psutil.Process]) -> None:
    """However a run ended: the front, its process group and every descendant seen gone, and
    the runtime directory swept (workers a killed front recorded, its stale segments)."""
    process = front.process
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)  # a drain: the workers are stopped by the front
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=REAP_S)
    alive = still_running(seen)
    for child in alive:  # the zygote and the workers run in sessions of their own
        with suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=REAP_S)
    prepare_runtime(front.job_runtime)


# -- one run ---------------------------------------------------------------------------------


@dataclass
class RunRecord:
    front: str
    engine: str
    steps: int
    wall_s: float = 0.0
    exit_code: int | None = None
    error: str | None = None
    samples: list[Sample] = field(default_factory=list)
    step_times: dict[int, float] = field(default_factory=dict)
    leftovers: Leftovers = field(default_factory=Leftovers)
    bounds: dict[str, float | None] = field(default_factory=dict)  # bytes; None: unbounded


def soak_once(
    front_name: str, engine: Engine, steps: int, sample_s: float, log_max_mb: float | None
) -> RunRecord:
    record = RunRecord(front_name, engine.name, steps)
    with tempfile.TemporaryDirectory(prefix="ts-soak-") as directory:
        layout = Layout(Path(directory))
        env = job_env(layout, steps, front_name, log_max_mb)
        front_type = RunFront if front_name == "run" else DaemonFront
        front = front_type(engine, layout, steps, env)
        record.bounds = disk_bounds(engine, env, front_name)
        seen: dict[int, psutil.Process] = {}
        started = time.monotonic()
        try:
            front.start()
            record.samples = watch(front, sample_s, seen)
            record.exit_code = front.finish()
            record.wall_s = time.monotonic() - started
            record.leftovers = left_behind(front, seen)
            record.step_times = front.step_times()
        except Exception as exc:  # the run is reported failed; the next one still runs
            record.error = f"{type(exc).__name__}: {exc}"
            record.wall_s = time.monotonic() - started
            print(f"{front_name}/{engine.name}: {record.error}\n{tail(layout.output)}")
        finally:
            reap(front, seen)
    return record


def disk_bounds(engine: Engine, env: dict[str, str], front: str) -> dict[str, float | None]:
    """What configuration bounds each rotated area to, in bytes (None: nothing does)."""
    log = load_config(engine.config, {**os.environ, **env}, probe=False).config.log
    # [log] max_mb and keep are new (rotating.py): a tree without them rotates nothing.
    max_mb: float = getattr(log, "max_mb", 0.0)
    keep: int = getattr(log, "keep", 0)
    rotated = (1 + keep) * max_mb * MIB if max_mb > 0 else None
    bounds: dict[str, float | None] = {"log": rotated, "trace": rotated}
    if front == "daemon":
        bounds["state"] = 2 * JOURNAL_MAX_BYTES + MIB  # journal.jsonl and .1; progress.json
    return bounds


# -- fits and verdicts -----------------------------------------------------------------------


def per_thousand(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares growth of y per 1,000 steps of x; None for too few points to say."""
    if len(points) < 3 or len({x for x, _ in points}) < 2:
        return None
    xs, ys = zip(*points, strict=True)
    return statistics.linear_regression(xs, ys).slope * PER


def blocks(points: Sequence[tuple[float, float]]) -> list[Sequence[tuple[float, float]]]:
    """`points` (in step order) cut into at most BLOCKS runs of at least PER_BLOCK each."""
    count = min(BLOCKS, len(points) // PER_BLOCK)
    if count < 3:
        return []
    size = len(points) / count
    return [points[round(i * size) : round((i + 1) * size)] for i in range(count)]


def floor_growth(points: Sequence[tuple[float, float]]) -> float | None:
    """Growth per 1,000 steps of the floor: each block's least value, at its middle step.

    A process's RSS (and descriptors, and a directory's bytes) moves with the phase it is
    sampled in: a rollout engine asleep holds no KV cache, a trainer offloaded no optimiser
    state, a checkpoint is written before the old one is pruned. Sampled at random phases that
    is tens of MiB of noise on a target of 1 MiB per 1,000 steps; the floor, the same state
    every time, is not. A leak raises every level, the floor included."""
    return per_thousand(
        [(statistics.fmean(x for x, _ in b), min(y for _, y in b)) for b in blocks(points)]
    )


def median_growth(points: Sequence[tuple[float, float]]) -> float | None:
    """Growth per 1,000 steps of each block's median (step times: a pause is not a trend)."""
    return per_thousand(
        [
            (statistics.fmean(x for x, _ in b), statistics.median(y for _, y in b))
            for b in blocks(points)
        ]
    )


def rate_growth(points: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
    """For a running total (CPU seconds) against steps: its median rate per step over the
    blocks, and that rate's growth per 1,000 steps (work per step that grows with the step)."""
    rates = [
        (statistics.fmean(x for x, _ in b), (b[-1][1] - b[0][1]) / (b[-1][0] - b[0][0]))
        for b in blocks(points)
        if b[-1][0] > b[0][0]
    ]
    if not rates:
        return None, None
    return statistics.median(rate for _, rate in rates), per_thousand(rates)


def window(record: RunRecord) -> list[Sample]:
    """The samples fitted: after the warm-up, before the last step (the job tears down)."""
    first = math.ceil(WARMUP * record.steps)
    return [s for s in record.samples if first <= s.step < record.steps]


def process_rows(samples: list[Sample]) -> list[dict[str, Any]]:
    """Per process: its last figures and their growth per 1,000 steps."""
    by_pid: dict[int, list[tuple[int, ProcessSample]]] = defaultdict(list)
    for sample in samples:
        for process in sample.processes:
            by_pid[process.pid].append((sample.step, process))
    rows = []
    for pid, points in by_pid.items():
        first, last = points[0][1], points[-1][1]
        rss = [(step, p.rss / MIB) for step, p in points]
        cpu_ms, cpu_ms_per_1k = rate_growth([(step, p.cpu_s * 1e3) for step, p in points])
        rows.append(
            {
                "pid": pid,
                "label": last.label,
                "role": last.role,
                "samples": len(points),
                "rss_mib": last.rss / MIB,
                "rss_floor_mib_per_1k": floor_growth(rss),
                "rss_all_mib_per_1k": per_thousand(rss),
                "peak_rise_mib": (last.peak - first.peak) / MIB,
                "fds": last.fds,
                "fds_per_1k": floor_growth([(step, p.fds) for step, p in points]),
                "threads": last.threads,
                "threads_per_1k": floor_growth([(step, p.threads) for step, p in points]),
                "cpu_ms_per_step": cpu_ms,
                "cpu_ms_per_step_per_1k": cpu_ms_per_1k,
            }
        )
    return sorted(rows, key=lambda row: (rank_of_role(row["role"]), row["label"]))


ROLE_ORDER = ["front", "zygote", "trainer", "rollout"]


def rank_of_role(role: str) -> int:
    return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)


def disk_rows(record: RunRecord, samples: list[Sample]) -> list[dict[str, Any]]:
    if not record.samples:
        return []
    end = record.samples[-1].disk
    rows = []
    for area in end:
        kind = "flat" if area in ("runtime", "checkpoints") else "output"
        if area in record.bounds:
            kind = "rotated"
        bound = record.bounds.get(area)
        rows.append(
            {
                "area": area,
                "kind": kind,
                "end_mib": end[area] / MIB,
                "mib_per_1k": floor_growth([(s.step, s.disk[area] / MIB) for s in samples]),
                "bound_mib": None if bound is None else bound / MIB,
            }
        )
    return rows


def shm_figures(record: RunRecord, samples: list[Sample]) -> dict[str, Any]:
    return {
        "segments_max": max((s.shm_segments for s in record.samples), default=0),
        "mib_max": max((s.shm_bytes for s in record.samples), default=0) / MIB,
        "segments_per_1k": floor_growth([(s.step, s.shm_segments) for s in samples]),
        "mib_per_1k": floor_growth([(s.step, s.shm_bytes / MIB) for s in samples]),
    }


def cpu_figures(samples: list[Sample]) -> dict[str, Any]:
    """The CPU the whole job (front and descendants) spends per step, and its growth: the
    step time's trend without the other work of this shared machine in it."""
    totals = [(s.step, sum(p.cpu_s for p in s.processes) * 1e3) for s in samples if s.processes]
    median, growth = rate_growth(totals)
    return {
        "ms_per_step": median,
        "ms_per_step_per_1k": growth,
        "relative_per_1k": None if growth is None or not median else growth / median,
    }


def step_time_figures(record: RunRecord) -> dict[str, Any]:
    first = math.ceil(WARMUP * record.steps)
    points = [(step, s * 1e3) for step, s in sorted(record.step_times.items()) if step >= first]
    if not points:
        return {"steps": 0, "median_ms": None, "ms_per_1k": None, "relative_per_1k": None}
    median = statistics.median(ms for _, ms in points)
    slope = median_growth(points)
    return {
        "steps": len(points),
        "median_ms": median,
        "ms_per_1k": slope,
        "all_ms_per_1k": per_thousand(points),
        "relative_per_1k": None if slope is None or median <= 0 else slope / median,
    }


def verdict(values: Iterable[float | None], limit: float) -> str:
    """PASS when every fitted value is under `limit`; n/a when nothing could be fitted."""
    fitted = [v for v in values if v is not None]
    if not fitted:
        return "n/a"
    return "PASS" if max(fitted) < limit else "FAIL"


def disk_verdict(rows: list[dict[str, Any]]) -> str:
    flat = [r["mib_per_1k"] for r in rows if r["kind"] == "flat"]
    rotated = [r for r in rows if r["kind"] == "rotated"]
    over = [r for r in rotated if r["bound_mib"] is None or r["end_mib"] > r["bound_mib"]]
    flat_verdict = verdict(flat, DISK_FLAT_MAX_MIB)
    return "FAIL" if over or flat_verdict == "FAIL" else flat_verdict


def analyse(record: RunRecord) -> dict[str, Any]:
    samples = window(record)
    processes = process_rows(samples)
    disk = disk_rows(record, samples)
    shm = shm_figures(record, samples)
    step_time = step_time_figures(record)
    cpu = cpu_figures(samples)
    finished = max(record.step_times, default=0) >= record.steps
    clean = record.error is None and record.exit_code == 0 and finished
    verdicts = {
        "rss": verdict((p["rss_floor_mib_per_1k"] for p in processes), RSS_MAX_MIB),
        "fds": verdict((p["fds_per_1k"] for p in processes), FDS_MAX),
        "threads": verdict((p["threads_per_1k"] for p in processes), THREADS_MAX),
        "shm": worst(
            verdict([shm["segments_per_1k"]], SHM_SEGMENTS_MAX),
            verdict([shm["mib_per_1k"]], SHM_MAX_MIB),
        ),
        "disk": disk_verdict(disk),
        "step time": verdict([step_time["relative_per_1k"]], STEP_TIME_MAX),
        "cpu per step": verdict([cpu["relative_per_1k"]], STEP_TIME_MAX),
        "clean exit": "PASS" if clean and record.leftovers.none() else "FAIL",
    }
    if record.error is not None:  # a run cut short proves nothing about growth
        verdicts = {target: "FAIL" for target in verdicts}
    return {
        "processes": processes,
        "disk": disk,
        "shm": shm,
        "step_time": step_time,
        "cpu": cpu,
        "verdicts": verdicts,
    }


def worst(*verdicts: str) -> str:
    for candidate in ("FAIL", "n/a"):
        if candidate in verdicts:
            return candidate
    return "PASS"


# -- printing --------------------------------------------------------------------------------


def signed(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def print_run(record: RunRecord, figures: dict[str, Any]) -> None:
    fitted = window(record)
    span = f"steps {fitted[0].step}..{fitted[-1].step}" if fitted else "no samples"
    print(
        f"\n== {record.front} / {record.engine}: {record.steps} steps in {record.wall_s:.0f} s, "
        f"exit {record.exit_code}, {len(record.samples)} samples, fitted over {span} =="
    )
    if record.error:
        print(f"error: {record.error}")
    if fitted:
        loads = sorted(s.load for s in fitted)
        print(
            f"machine load (1 min, {os.cpu_count()} cores): {loads[0]:.1f} .. "
            f"{statistics.median(loads):.1f} .. {loads[-1]:.1f} (min, median, max)"
        )
    print_processes(figures["processes"])
    print_disk(figures["disk"])
    shm, st = figures["shm"], figures["step_time"]
    print(
        f"shm: at most {shm['segments_max']} segments, {shm['mib_max']:.1f} MiB; "
        f"{signed(shm['segments_per_1k'])} segments, {signed(shm['mib_per_1k'])} MiB per 1k steps"
    )
    if st["median_ms"] is not None:
        relative = "-" if st["relative_per_1k"] is None else f"{st['relative_per_1k']:+.1%}"
        print(
            f"step time: median {st['median_ms']:.1f} ms over {st['steps']} steps; per 1k steps "
            f"{signed(st['ms_per_1k'])} ms ({relative}) fitted to block medians, "
            f"{signed(st['all_ms_per_1k'])} ms to every step"
        )
    cpu = figures["cpu"]
    if cpu["ms_per_step"] is not None:
        relative = "-" if cpu["relative_per_1k"] is None else f"{cpu['relative_per_1k']:+.1%}"
        print(
            f"job CPU: {cpu['ms_per_step']:.1f} ms per step; per 1k steps "
            f"{signed(cpu['ms_per_step_per_1k'])} ms ({relative})"
        )
    left = record.leftovers
    if not left.none():
        print(f"left behind: {left.processes} {left.segments} segments {left.sockets}")


def print_processes(rows: list[dict[str, Any]]) -> None:
    """Per 1k steps: RSS's floor (the target's) and every sample's fit; peak+: VmHWM's rise
    over the fitted steps; cpu: ms per step, and its growth."""
    print(
        f"{'process':<10} {'n':>4} {'RSS MiB':>7} {'floor/1k':>8} {'all/1k':>7} {'peak+':>5} "
        f"{'fds':>4} {'/1k':>5} {'thr':>3} {'/1k':>5} {'cpu ms':>6} {'/1k':>6}"
    )
    for p in rows:
        cpu = "-" if p["cpu_ms_per_step"] is None else f"{p['cpu_ms_per_step']:.1f}"
        print(
            f"{p['label']:<10} {p['samples']:>4} {p['rss_mib']:>7.1f} "
            f"{signed(p['rss_floor_mib_per_1k']):>8} {signed(p['rss_all_mib_per_1k']):>7} "
            f"{p['peak_rise_mib']:>5.1f} {p['fds']:>4} {signed(p['fds_per_1k'], 1):>5} "
            f"{p['threads']:>3} {signed(p['threads_per_1k'], 1):>5} {cpu:>6} "
            f"{signed(p['cpu_ms_per_step_per_1k'], 1):>6}"
        )


def print_disk(rows: list[dict[str, Any]]) -> None:
    print(f"{'area':<12} {'kind':<8} {'end MiB':>9} {'MiB/1k':>9}  bound")
    for d in rows:
        bound = "-" if d["bound_mib"] is None else f"{d['bound_mib']:.0f} MiB"
        if d["kind"] == "rotated" and d["bound_mib"] is None:
            bound = "none: grows without bound"
        print(
            f"{d['area']:<12} {d['kind']:<8} {d['end_mib']:>9.2f} "
            f"{signed(d['mib_per_1k'], 3):>9}  {bound}"
        )


def print_verdicts(records: list[RunRecord], analyses: list[dict[str, Any]]) -> None:
    names = [f"{r.front}/{r.engine}" for r in records]
    limits = {
        "rss": f"< {RSS_MAX_MIB:g} MiB/1k",
        "fds": f"< {FDS_MAX:g}/1k",
        "threads": f"< {THREADS_MAX:g}/1k",
        "shm": "flat",
        "disk": "bounded",
        "step time": f"< {STEP_TIME_MAX:.0%}/1k",
        "cpu per step": f"< {STEP_TIME_MAX:.0%}/1k",
        "clean exit": "nothing left",
    }
    width = max(16, *(len(n) + 2 for n in names))
    print("\n" + f"{'target':<26}" + "".join(f"{n:>{width}}" for n in names))
    for target, limit in limits.items():
        cells = "".join(f"{a['verdicts'][target]:>{width}}" for a in analyses)
        print(f"{target + ' (' + limit + ')':<26}{cells}")


# -- main ------------------------------------------------------------------------------------


def sample_json(sample: Sample) -> dict[str, Any]:
    return asdict(sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--front", choices=[*FRONTS, "both"], default="both")
    parser.add_argument("--engine", choices=[*ENGINES, "both"], default="both")
    parser.add_argument("--steps", type=int, help="every run's steps (default: the engine's)")
    parser.add_argument(
        "--sample-s", type=float, help="seconds between samples (default: the engine's)"
    )
    parser.add_argument(
        "--log-max-mb",
        type=float,
        help="[log] max_mb for the runs (default: the config's), to see the log rotate",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engines = list(ENGINES) if args.engine == "both" else [args.engine]
    fronts = list(FRONTS) if args.front == "both" else [args.front]
    records, analyses = [], []
    for engine_name in engines:
        engine = ENGINES[engine_name]
        for front in fronts:
            steps = args.steps or engine.steps
            print(f"soak: {front} / {engine_name}, {steps} steps ...", flush=True)
            sample_s = args.sample_s or engine.sample_s
            record = soak_once(front, engine, steps, sample_s, args.log_max_mb)
            analysis = analyse(record)
            print_run(record, analysis)
            records.append(record)
            analyses.append(analysis)
    print_verdicts(records, analyses)
    if args.json:
        write_json(args, records, analyses)
    if any("FAIL" in a["verdicts"].values() for a in analyses):
        sys.exit(1)


def write_json(
    args: argparse.Namespace, records: list[RunRecord], analyses: list[dict[str, Any]]
) -> None:
    runs = []
    for record, analysis in zip(records, analyses, strict=True):
        run = {key: value for key, value in asdict(record).items() if key not in ("samples",)}
        run["step_times"] = {str(k): v for k, v in record.step_times.items()}
        runs.append({**run, **analysis, "samples": [sample_json(s) for s in record.samples]})
    out = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "targets": {
            "rss_mib_per_1k": RSS_MAX_MIB,
            "fds_per_1k": FDS_MAX,
            "threads_per_1k": THREADS_MAX,
            "shm_segments_per_1k": SHM_SEGMENTS_MAX,
            "shm_mib_per_1k": SHM_MAX_MIB,
            "disk_flat_mib_per_1k": DISK_FLAT_MAX_MIB,
            "step_time_relative_per_1k": STEP_TIME_MAX,
            "warmup": WARMUP,
        },
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
