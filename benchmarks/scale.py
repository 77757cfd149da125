"""What the cycle costs per phase as a job grows from 1 to 16 nodes, and what that projects to.

    python benchmarks/scale.py --nodes 1 2 4 8 16 --steps 60 --json runs/scale.json
    python benchmarks/scale.py --peers --json runs/scale-peers.json

One job of simulated engines (examples/simulated.toml: real worker processes, lanes, weight
channel and barriers, no model) runs over 1, 2, 4, 8 and 16 node daemons on loopback: one
`timeshare run` per node, `--ranks-per-node` ranks each (default 1), the leader's job store on
a fresh free port, each node count in a fresh directory under /tmp. Every figure is a node's
own clock; per step the slowest node's, and the table shows the median over steps 2..N.

What the rows are made of. The phase rows (and `step`, TRAIN's start to ROLLOUT's end) come
from each node's `--summary`. The rest comes from the cycle's records in each node's log file
(`[log] file`: `cycle.phase.ended` carries when a phase started, when both workers had
answered and when it was reported; `cycle.moment.marked` has "nodes met before X"):

- commands: the six phases' commands, from starting them to both workers' answers, summed;
- cross>sync, cross>resume, cross>train: the crossing of the nodes at each fence, from the
  node's last report of the phase before to "nodes met"; the slowest node's includes waiting
  for the last node to arrive. cross>resume is the job-wide store barrier: BARRIER itself only
  meets the node's own ranks in its driver (cycle/meeting.py);
- crossing own: the three crossings, each of the node that arrived last at it (no waiting: the
  store round trips of arriving, reading every node's value, folding it and waking the others);
- driver: the rest of a cycle, the driver's hops between one phase's report and the next start;
- cycle: TRAIN's start to the next TRAIN's start (step, plus the crossing before TRAIN);
- daemon cpu, workers cpu: the CPU ms one node's daemon (its driver, beat, crossings and
  command poll; on the leader the job store's server too) and its zygote and workers use per
  cycle, from /proc sampled every WATCH_S over the steady cycles ("-" where those last under
  CPU_WINDOW_S, as one node's do: /proc counts in 10 ms ticks); busy cores: all of them;
  other cores: the machine's other work meanwhile (this VM is shared).

Within a phase the records cannot split the command's wire time from the worker's own code;
the beat runs beside the phases in a thread and shows only in the daemon's CPU.

Each row is fitted by least squares, ms = a + b * nodes, and its growth exponent k is fitted
on log-log: log(ms(n) - ms(n0)) against log(n - n0), n0 the smallest count, so that k is 1
for a rise linear in nodes and 2 for a quadratic one whatever the constant part (a row that
rises less than FLAT_MS over the sweep is flat). Projections to 32, 128 and 1,024 nodes are
the line's, and the power law's (ms(n0) + c * (n - n0)**k). Rows that only exist across nodes
(the crossings) are fitted from 2 nodes on. Target (issue 27): every phase and crossing
<= 10 ms at 16 nodes, growth no worse than linear.

On this 2-core VM 16 nodes of one rank are 16 daemons, 16 zygotes and 32 workers: the machine
is loaded, so the job's deadlines are raised through TIMESHARE_DEADLINES__* (UNDER_LOAD below)
so that a slow machine is not declared failed; they are only deadlines and change no figure.
What grows with nodes here is in part the protocol and in part 2 cores shared by ever more
processes: the CPU rows say how busy the cores were and whose work it was. A node count
stops the sweep, reported and not a crash, when it fails, runs past --wall-s, or would not fit
in memory (each node's share measured on the count before); every process a run started is
stopped and swept by its directory's name, on every path.

--peers separates the two. Node 0, the leader, is a whole node (`timeshare run`, its zygote and
workers, the job store it hosts); nodes 1..n-1 are protocol peers, one process of them
(benchmarks/peers.py): each does in the store what a node's daemon does (its beat, the start's
agreement and every crossing, its state, the command poll), with the daemon's own code, and has
no workers. That is what the other nodes of a cluster cost one node, which has cores of its
own: the requests they send the store and how long they keep it at a fence. A peer arrives at a
fence at once, so the leader arrives last at every crossing, and its rows are its own cost at
that node count, nothing of the others' phases; the peers' CPU shows in `other cores`. The
leader (its daemon, the store it hosts, its zygote and workers) runs on half of the machine's
cores and the peers on the other half (taskset), as other machines would: on this VM, one core
each. The peers say how long they waited at a fence for the leader (printed below the table):
a wait of about nothing would be a peer that came last, whose lateness the leader's rows hold.

At 1,024 nodes (the printed note puts numbers on it): every node's beat, crossing and command
poll goes to the one TCPStore the leader's daemon hosts. A beat (every BEAT_S = 0.5 s) writes
the node's record, checks that the records it reads are there and reads them in one multi_get
(protocols/nodes.py `beat_once`, `JobStore.read_present`): a few requests per node, linear
job-wide. The leader reads every record at every beat; a follower the leader's and its own, and
every record one beat in ceil(n/16) (every beat up to 16 nodes), so the records the store sends
are ~n + 18n a beat at 1,024 nodes, not n^2 (as when every node read every record). A
crossing (protocols/barrier.py `Barrier.agree`) is a put and an add per node; the node that
arrives last reads every value in one multi_get, folds them and wakes every other node with
the result in one multi_set, and a woken node reads that one value: linear in requests and
bytes, and nothing polls (this benchmark's first sweep found every node reading every value one
round trip at a time, n^2 requests: the crossings grew with k 1.4-1.6; the second, every node
polling and reading every value in one multi_get). The command poll (cycle/commands.py, every
0.5 s on several nodes: a crossing reads the commands too) and the state publish (several nodes:
at most every 0.5 s, a new lifecycle at once) are one request per node. The store probe
(--probe-nodes 1024)
times, against a job store on loopback, one node's beat at that many nodes, the reads of every
value at a crossing one by one (as every node once made them) and as one multi_get (as the last
node makes them now), and the store's throughput with 8 clients.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from timeshare.cycle.commands import NODES_POLL_S as COMMANDS_POLL_S
from timeshare.cycle.runner import NODES_PUBLISH_EVERY_S
from timeshare.protocols.nodes import BEAT_S, FULL_READ_NODES, NodeBeat, record_key
from timeshare.protocols.store import PREFIX, JobStore
from timeshare.report.summary import read_summary

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "simulated.toml"
PEERS = ROOT / "benchmarks" / "peers.py"
PHASES = ("train", "offload", "sync", "barrier", "resume", "rollout")
# Each fence's crossing: the phase it follows, and the phase it opens.
FENCES = {"cross>sync": ("offload", "sync"), "cross>resume": ("barrier", "resume")}
CROSS_TRAIN = "cross>train"  # follows ROLLOUT of step s, opens TRAIN of step s+1
CROSSINGS = (*FENCES, CROSS_TRAIN)
PHASE_ROWS = (*PHASES, "step")
OWN = "crossing own"  # the three crossings, each of the node that arrived last at it
PART_ROWS = ("commands", *CROSSINGS, OWN, "driver", "cycle")
# ms per node per cycle; the cores this run kept busy, and the cores anything else did
CPU_ROWS = ("daemon cpu", "workers cpu", "busy cores", "other cores")
FITTED_ROWS = (*PHASE_ROWS, *PART_ROWS, *CPU_ROWS[:2])
MULTI_NODE_ROWS = frozenset({*CROSSINGS, OWN})
TARGET_ROWS = frozenset({*PHASES, *CROSSINGS})
TARGET_MS = 10.0
TARGET_NODES = 16
FLAT_MS = 0.5  # a rise below this over the sweep is noise on this VM, not growth
LINEAR_K = 1.25  # a growth exponent up to this is linear within the noise of 5 points
PROJECT_TO = (32, 128, 1024)

# Deadlines a loaded 2-core machine meets (examples/simulated.toml has 10-60 s, node_s 5 s):
# 48 Python processes start at once, and a beat's thread may wait seconds for a core.
UNDER_LOAD = {
    "TIMESHARE_DEADLINES__PHASE_S": "120",
    "TIMESHARE_DEADLINES__STALL_S": "60",
    "TIMESHARE_DEADLINES__BARRIER_S": "120",
    "TIMESHARE_DEADLINES__READY_S": "600",
    "TIMESHARE_DEADLINES__NODE_S": "60",
}
WATCH_S = 0.1  # how often a run's processes, their CPU and the free memory are looked at
PID_LIST_S = 1.0  # how often /proc is scanned for the run's processes
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# /proc counts CPU in ticks (10 ms) per process: over a shorter window that is most of a figure.
CPU_WINDOW_S = 1.0
GRACE_S = 15.0  # SIGTERM to SIGKILL: a daemon stops its workers and removes its staging
GONE_S = 10.0  # SIGKILL to every process gone
NODE_MB_GUESS = 800.0  # one node's daemon, zygote and two workers (RSS), before any is measured
PROBE_THREADS = 8
RECORD_BYTES = 320  # a node's record as JSON, 8 ranks of 8 phases (protocols/nodes.py)


# -- running one node count ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


@dataclass(frozen=True)
class Layout:
    """One run's job: its config, over so many nodes of so many ranks, for so many steps."""

    config: Path
    nodes: int
    ranks_per_node: int
    steps: int
    peers: bool = False  # nodes 1..n-1 are protocol peers (benchmarks/peers.py), not daemons

    @property
    def real_nodes(self) -> int:
        """The nodes that run `timeshare run` (their records make the figures)."""
        return 1 if self.peers else self.nodes


def node_env(layout: Layout, root: Path, node: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        **UNDER_LOAD,
        "TIMESHARE_JOB__STEPS": str(layout.steps),
        "TIMESHARE_JOB__RANKS": str(layout.nodes * layout.ranks_per_node),
        "TIMESHARE_JOB__RUNTIME_DIR": str(root / f"r{node}"),
        "TIMESHARE_JOB__CHECKPOINT_DIR": str(root / "checkpoints"),
        "TIMESHARE_CLUSTER__NODES": str(layout.nodes),
        "TIMESHARE_CLUSTER__NODE_RANK": str(node),
        "TIMESHARE_CLUSTER__RANKS_PER_NODE": str(layout.ranks_per_node),
        "TIMESHARE_CLUSTER__LEADER_PORT": str(port),
        "TIMESHARE_LOG__FILE": str(root / f"log{node}.jsonl"),
        "TIMESHARE_LOG__MAX_MB": "0",  # never rotated: a node's records are in that one file
    }


def start_nodes(
    processes: list[subprocess.Popen[bytes]], outputs: list[Path], layout: Layout, root: Path
) -> None:
    """One `timeshare run` per node, the leader first, into `processes` as each starts (the
    caller stops those started if a later one cannot); each one's output in its node{n}.out
    (`outputs`). With peers, one process of them after the leader, its output in peers.out."""
    port = free_port()
    on_leader_cores, on_peer_cores = split_cores(layout.peers)
    for node in range(layout.real_nodes):
        command = [
            sys.executable,
            "-m",
            "timeshare",
            "run",
            str(layout.config),
            "--summary",
            str(root / f"node{node}.json"),
        ]
        env = node_env(layout, root, node, port)
        outputs.append(root / f"node{node}.out")
        with outputs[-1].open("wb") as out:  # the child keeps its own copy
            processes.append(
                subprocess.Popen(
                    [*on_leader_cores, *command],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    if layout.peers and layout.nodes > 1:
        command = [
            sys.executable,
            str(PEERS),
            *("--port", str(port), "--nodes", str(layout.nodes)),
            *("--ranks-per-node", str(layout.ranks_per_node), "--tag", str(root / "peers")),
            *("--lost-s", UNDER_LOAD["TIMESHARE_DEADLINES__NODE_S"]),
        ]
        outputs.append(root / "peers.out")
        with outputs[-1].open("wb") as out:
            processes.append(
                subprocess.Popen(
                    [*on_peer_cores, *command],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=os.environ,
                )
            )


def split_cores(peers: bool) -> tuple[list[str], list[str]]:
    """--peers: what runs a command (and all it starts, from its first instruction) on the
    leader's half of this machine's cores, and on the peers' half (as other machines' would
    be). Nothing to prefix for whole nodes, or a single core: they share them all."""
    cores = sorted(os.sched_getaffinity(0))
    if not peers or len(cores) < 2 or shutil.which("taskset") is None:
        return [], []
    half = len(cores) // 2
    return _taskset(cores[:half]), _taskset(cores[half:])


def _taskset(cores: list[int]) -> list[str]:
    return ["taskset", "--cpu-list", ",".join(map(str, cores))]


@dataclass
class Outcome:
    status: str  # ok, failed, timeout, memory, unreadable
    why: str = ""
    failed_node: int | None = None
    lowest_mb: float = math.inf  # the least memory available while it ran


def watch(
    processes: list[subprocess.Popen[bytes]],
    outputs: list[Path],
    sampler: CpuSampler,
    wall_s: float,
    floor_mb: float,
) -> Outcome:
    """Until every node exited 0, one failed, the wall limit passed or memory ran low; the
    run's CPU sampled meanwhile."""
    deadline = time.monotonic() + wall_s
    outcome = Outcome("ok")
    while True:
        codes = [process.poll() for process in processes]
        failed = [(node, code) for node, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            node, code = failed[0]
            outcome.status, outcome.why = "failed", f"{outputs[node].stem} exited {code}"
            outcome.failed_node = node
            return outcome
        if all(code == 0 for code in codes):
            return outcome
        available = mem_available_mb()
        outcome.lowest_mb = min(outcome.lowest_mb, available)
        if available < floor_mb:
            outcome.status = "memory"
            outcome.why = f"memory available fell to {available:.0f} MB (< {floor_mb:.0f} MB)"
            return outcome
        if time.monotonic() > deadline:
            outcome.status, outcome.why = "timeout", f"not done within --wall-s {wall_s:g} s"
            return outcome
        sampler.sample()
        time.sleep(WATCH_S)


def processes_of(root: Path) -> list[int]:
    """Every live process whose command line names `root`: the daemons (their summary path),
    the zygotes (their runtime dir) and the workers they forked (the zygote's argv)."""
    mark = f"{root}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


class Sample(NamedTuple):
    at: float  # time.monotonic()
    daemons: float  # CPU seconds used so far
    workers: float
    machine: float  # every process's, this run's and others'


class CpuSampler:
    """The CPU seconds this run's processes have used, over time, by role: the daemons (the
    driver, its beat, crossings and command polls; on the leader also the job store) and the
    workers (with their zygotes). A process's last reading stays counted after it exits."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.roles: dict[int, str] = {}
        self.used: dict[int, float] = {}
        self.samples: list[Sample] = []
        self.listed_at = -math.inf

    def sample(self) -> None:
        now = time.monotonic()
        if now - self.listed_at > PID_LIST_S:  # a scan of /proc: not at every sample
            for pid in processes_of(self.root):
                self.roles.setdefault(pid, role_of(pid))
            self.listed_at = now
        for pid in self.roles:
            used = cpu_s_of(pid)
            if used is not None:
                self.used[pid] = used
        daemons = sum(s for pid, s in self.used.items() if self.roles[pid] == "daemon")
        workers = sum(s for pid, s in self.used.items() if self.roles[pid] == "workers")
        self.samples.append(Sample(now, daemons, workers, machine_busy_s()))


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy since boot (whoever's work)."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / CLOCK_TICKS  # (guest time is counted in user already)


def role_of(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "workers"
    if any(arg.endswith(b"peers.py") for arg in argv):
        return "peers"
    return "daemon" if b"run" in argv and b"timeshare" in argv else "workers"


def cpu_s_of(pid: int) -> float | None:
    """User and system CPU seconds of `pid` (None: gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces: after its ')'
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def stop_all(processes: list[subprocess.Popen[bytes]], root: Path) -> list[int]:
    """Stop every node (SIGTERM: a daemon stops its workers), then SIGKILL whatever of this
    run is left; the pids still alive after that (none, unless something is badly stuck)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            process.kill()
    for pid in processes_of(root):  # a zygote or worker its daemon left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for process in processes:
        try:
            process.wait(timeout=GONE_S)  # reaped: no zombie of ours is left either
        except subprocess.TimeoutExpired:
            continue  # (stuck in the kernel: it shows among the pids returned)
    deadline = time.monotonic() + GONE_S
    while (left := processes_of(root)) and time.monotonic() < deadline:
        time.sleep(WATCH_S)
    return left


def tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class CountRun:
    """One node count: how it went, and each node's steps and records if it ran to the end."""

    nodes: int
    outcome: Outcome
    run_s: float = 0.0
    cpu_s: float = 0.0
    used_mb: float = 0.0  # memory available before, less the least while it ran
    leftovers: list[int] = field(default_factory=list)
    cpu_samples: list[Sample] = field(default_factory=list)
    summaries: list[list[dict[str, Any]]] = field(default_factory=list)
    records: list[list[dict[str, Any]]] = field(default_factory=list)
    peers: dict[str, Any] | None = None  # --peers: what the peers said as they left


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every reaped descendant's
    return usage.ru_utime + usage.ru_stime


def run_count(layout: Layout, *, wall_s: float, floor_mb: float) -> CountRun:
    with tempfile.TemporaryDirectory(prefix="tss-", dir="/tmp") as directory:
        root = Path(directory)  # short: a worker's socket path must stay under 107 bytes
        before_mb, cpu_before = mem_available_mb(), children_cpu_s()
        started = time.monotonic()
        processes: list[subprocess.Popen[bytes]] = []
        outputs: list[Path] = []
        sampler = CpuSampler(root)
        try:
            start_nodes(processes, outputs, layout, root)
            outcome = watch(processes, outputs, sampler, wall_s, floor_mb)
        finally:  # an error or an interrupt here too: nothing of this run is left behind
            leftovers = stop_all(processes, root)
        run = CountRun(
            layout.nodes,
            outcome,
            run_s=time.monotonic() - started,
            cpu_s=children_cpu_s() - cpu_before,
            used_mb=max(before_mb - outcome.lowest_mb, 0.0),
            leftovers=leftovers,
            cpu_samples=sampler.samples,
        )
        if outcome.failed_node is not None:
            outcome.why += f": {tail(outputs[outcome.failed_node])}"
        if outcome.status == "ok":
            read_nodes(run, root, layout.real_nodes)
        if layout.peers and layout.nodes > 1:
            run.peers = peers_said(root / "peers.out")
        return run


def peers_said(path: Path) -> dict[str, Any] | None:
    """The peers' last line (benchmarks/peers.py `outcome`): their crossings, their waits."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    said = [line.removeprefix("peers: ") for line in lines if line.startswith("peers: {")]
    return json.loads(said[-1]) if said else None


def read_nodes(run: CountRun, root: Path, real_nodes: int) -> None:
    """Every real node's summary and timeline records into `run`; one that cannot be read
    makes the count's outcome "unreadable", saying which (reported like a failure, not raised)."""
    for node in range(real_nodes):
        try:
            run.summaries.append(read_summary(root / f"node{node}.json").steps)
            run.records.append(read_records(root / f"log{node}.jsonl"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            run.outcome.status = "unreadable"
            run.outcome.why = f"node {node}'s summary or log: {type(exc).__name__}: {exc}"
            run.summaries, run.records = [], []
            return


def read_records(path: Path) -> list[dict[str, Any]]:
    """The cycle's timeline records in a node's log (its workers' lines are skipped)."""
    records = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("event") in ("cycle.phase.ended", "cycle.moment.marked"):
            records.append(entry["record"])
    return records


# -- one node's steps, from its records ----------------------------------------------------------


@dataclass
class Span:
    start: float
    answered: float
    end: float


def phase_spans(records: list[dict[str, Any]]) -> dict[int, dict[str, Span]]:
    """Per step and phase, the node's span over its ranks: first start, last answer, last
    report."""
    spans: dict[int, dict[str, Span]] = defaultdict(dict)
    for record in records:
        if "phase" not in record:
            continue
        end = record["start"] + record["seconds"]
        known = spans[record["step"]].get(record["phase"])
        if known is None:
            spans[record["step"]][record["phase"]] = Span(record["start"], record["answered"], end)
        else:
            known.start = min(known.start, record["start"])
            known.answered = max(known.answered, record["answered"])
            known.end = max(known.end, end)
    return {step: by_phase for step, by_phase in spans.items() if len(by_phase) == len(PHASES)}


def met_times(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """When the nodes met before each phase, in order ("nodes met before SYNC" -> "sync")."""
    met: dict[str, list[float]] = defaultdict(list)
    for record in records:
        name = record.get("name", "")
        if name.startswith("nodes met before "):
            met[name.removeprefix("nodes met before ").lower()].append(record["at"])
    return {phase: sorted(times) for phase, times in met.items()}


def crossing_s(met: dict[str, list[float]], opens: str, after: float) -> float | None:
    """From `after` (the report that opened the fence) to the nodes' meeting before `opens`."""
    times = met.get(opens, [])
    index = bisect.bisect_left(times, after)
    return times[index] - after if index < len(times) else None


def covered_s(intervals: list[tuple[float, float]]) -> float:
    """The time inside at least one interval (a node's ranks may be in two phases at once:
    one rank's OFFLOAD can start while another's TRAIN runs, no fence between them)."""
    covered, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def node_parts(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per step (one whose next step also ran): seconds of commands, crossings, driver, cycle."""
    spans, met = phase_spans(records), met_times(records)
    parts: dict[int, dict[str, float]] = {}
    for step, by_phase in spans.items():
        following = spans.get(step + 1)
        if following is None:
            continue
        cycle = following["train"].start - by_phase["train"].start
        row = {
            "commands": sum(s.answered - s.start for s in by_phase.values()),
            "cycle": cycle,
        }
        crossings = {
            name: crossing_s(met, opens, by_phase[before].end)
            for name, (before, opens) in FENCES.items()
        }
        crossings[CROSS_TRAIN] = crossing_s(met, "train", by_phase["rollout"].end)
        row.update({name: s for name, s in crossings.items() if s is not None})
        in_phases = covered_s([(s.start, s.end) for s in by_phase.values()])
        row["driver"] = cycle - in_phases - sum(s for s in crossings.values() if s is not None)
        parts[step] = row
    return parts


# -- the job's figures: the slowest node per step, the median over steps -------------------------


def steady_steps(steps: list[int]) -> list[int]:
    return sorted(steps)[1:]  # the first is the warm-up (nodes.py: steps 2..N)


def median_ms(per_step: list[float]) -> float | None:
    return statistics.median(per_step) * 1000 if per_step else None


def summary_rows(summaries: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """Per phase and step: the median over steps 2..N of the slowest node's seconds."""
    by_node = [{s["step"]: s for s in node} for node in summaries]
    steps = steady_steps(list(set.intersection(*(set(node) for node in by_node))))
    rows = {
        phase: median_ms([max(node[s]["phases"][phase] for node in by_node) for s in steps])
        for phase in PHASES
    }
    rows["step"] = median_ms([max(node[s]["step_s"] for node in by_node) for s in steps])
    return rows


def part_rows(records: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """Per part: the median over steps of the slowest node's; "crossing own" of the node that
    arrived last (the least time at each crossing). None: a crossing on one node (there is
    none)."""
    by_node = [node_parts(node) for node in records]
    steps = steady_steps(list(set.intersection(*(set(node) for node in by_node))))

    def slowest(name: str) -> float | None:
        if not all(name in node[s] for s in steps for node in by_node):
            return None
        return median_ms([max(node[s][name] for node in by_node) for s in steps])

    rows = {name: slowest(name) for name in PART_ROWS if name != OWN}
    if all(rows[crossing] is not None for crossing in CROSSINGS):
        last_in = [sum(min(node[s][c] for node in by_node) for c in CROSSINGS) for s in steps]
        rows[OWN] = median_ms(last_in)
    else:
        rows[OWN] = None
    return {name: rows[name] for name in PART_ROWS}


def steady_window(records: list[list[dict[str, Any]]]) -> tuple[float, float, int] | None:
    """The steady cycles (steps 2..N-1 and the crossing after each): from the first TRAIN's
    start on any node to the last's next TRAIN start on every node, and how many cycles."""
    spans = [phase_spans(node) for node in records]
    common = set.intersection(*(set(node) for node in spans))
    steps = steady_steps([step for step in common if step + 1 in common])
    if len(steps) < 2:
        return None
    first, last = steps[0], steps[-1] + 1
    start = min(node[first]["train"].start for node in spans)
    end = max(node[last]["train"].start for node in spans)
    return start, end, last - first


def cpu_rows(samples: list[Sample], records: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """Over the steady cycles: the CPU ms a node's daemon and its workers use per cycle, how
    many cores the run kept busy, and how many other processes of the machine did. None: a
    window shorter than CPU_WINDOW_S (one node runs its steps in a fraction of a second)."""
    window = steady_window(records)
    if window is None or window[1] - window[0] < CPU_WINDOW_S:
        return dict.fromkeys(CPU_ROWS)
    inside = [s for s in samples if window[0] <= s.at <= window[1]]
    if len(inside) < 2:  # (the benchmark's own sampling starved of CPU)
        return dict.fromkeys(CPU_ROWS)
    first, last = inside[0], inside[-1]
    seconds = last.at - first.at
    daemons_busy = (last.daemons - first.daemons) / seconds  # cores
    workers_busy = (last.workers - first.workers) / seconds
    machine_busy = (last.machine - first.machine) / seconds
    per_node_cycle_ms = (window[1] - window[0]) / window[2] / len(records) * 1000
    return {
        "daemon cpu": daemons_busy * per_node_cycle_ms,
        "workers cpu": workers_busy * per_node_cycle_ms,
        "busy cores": daemons_busy + workers_busy,
        "other cores": max(machine_busy - daemons_busy - workers_busy, 0.0),
    }


def nodes_agree(summaries: list[list[dict[str, Any]]]) -> bool:
    """Every step, every node ended with the same weights."""
    digests = [{s["step"]: s["weights_digest"] for s in node} for node in summaries]
    return all(len({node[step] for node in digests}) == 1 for step in digests[0])


# -- fits ----------------------------------------------------------------------------------------


@dataclass
class Fit:
    a: float | None = None  # ms = a + b * nodes
    b: float | None = None
    r2: float | None = None
    k: float | None = None  # growth exponent over the smallest count
    c: float | None = None  # the power law's coefficient: rise = c * (n - n0) ** k
    base: float | None = None  # ms at the smallest count
    n0: int = 1
    growth: str = "n/a"

    def linear_at(self, nodes: int) -> float | None:
        if self.a is None or self.b is None:
            return None
        return self.a + self.b * nodes

    def power_at(self, nodes: int) -> float | None:
        if self.k is None or self.c is None or self.base is None:
            return None  # flat, or too few points that rose
        return self.base + self.c * math.pow(nodes - self.n0, self.k)


def fit_row(counts: list[int], values: list[float]) -> Fit:
    """The least-squares line, and the growth exponent of the rise over the smallest count."""
    fit = Fit()
    if len(counts) < 2:
        return fit
    line = statistics.linear_regression(counts, values)
    fit.a, fit.b = line.intercept, line.slope
    if len(set(values)) > 1:
        fit.r2 = statistics.correlation(counts, values) ** 2
    fit.n0, fit.base = counts[0], values[0]
    rises = [(n - counts[0], v - values[0]) for n, v in zip(counts, values, strict=True)][1:]
    if max(rise for _, rise in rises) < FLAT_MS:
        fit.growth = "flat"
        return fit
    positive = [(n, rise) for n, rise in rises if rise > 0]
    if len(positive) < 2:
        return fit
    log_line = statistics.linear_regression(
        [math.log(n) for n, _ in positive], [math.log(rise) for _, rise in positive]
    )
    fit.k, fit.c = log_line.slope, math.exp(log_line.intercept)
    fit.growth = "<= linear" if fit.k <= LINEAR_K else "SUPERLINEAR"
    return fit


def fit_all(rows_by_count: dict[int, dict[str, float | None]]) -> dict[str, Fit]:
    fits = {}
    for name in FITTED_ROWS:
        counts, values = [], []
        for n, row in sorted(rows_by_count.items()):
            value = row.get(name)
            if value is not None and (n > 1 or name not in MULTI_NODE_ROWS):
                counts.append(n)
                values.append(value)
        fits[name] = fit_row(counts, values)
    return fits


# -- the store probe: one node's share of a beat and a crossing at many nodes --------------------


def timed(call: Callable[[], object], repeats: int) -> float:
    """The median seconds of `call()` over `repeats`."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def throughput(host: str, port: int, keys: list[str], threads: int, each: int) -> float:
    """Reads per second the store serves to `threads` clients reading at once."""
    clients = [JobStore.connect(host, port, timeout_s=10.0) for _ in range(threads)]

    def read_many(client: JobStore) -> None:
        for i in range(each):
            client.read(keys[i % len(keys)])

    workers = [threading.Thread(target=read_many, args=(client,)) for client in clients]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60.0)
    return threads * each / (time.perf_counter() - started)


def store_probe(nodes: int) -> dict[str, float]:
    """Against a job store on loopback holding `nodes` nodes' records: a check and a get, one
    node's beat (write its record, read every node's: protocols/nodes.py), one node's read of
    every node's value at a crossing (protocols/barrier.py `values`), one check that every node
    arrived (`has_all`), the same values in one multi_get (what the store offers and the code
    does not use), and the store's read rate with PROBE_THREADS clients."""
    host = JobStore.host("127.0.0.1", 0, timeout_s=10.0)
    address = host.address
    client = JobStore.connect(*address, timeout_s=10.0)
    beats = [NodeBeat(client, node, nodes, 1, lost_s=60.0) for node in range(nodes)]
    for beat in beats:
        beat.write()
    keys = [record_key(node) for node in range(nodes)]
    return {
        "nodes": nodes,
        "check_ms": timed(lambda: client.has(keys[0]), 500) * 1000,
        "get_ms": timed(lambda: client.read(keys[0]), 500) * 1000,
        "beat_ms": timed(beats[0].beat_once, 5) * 1000,
        "values_ms": timed(lambda: [client.read(key) for key in keys], 5) * 1000,
        "has_all_ms": timed(lambda: client.has_all(keys), 50) * 1000,
        "multi_get_ms": timed(lambda: client.raw.multi_get([PREFIX + k for k in keys]), 5) * 1000,
        "reads_per_s": throughput(*address, keys, PROBE_THREADS, 2000),
        "threads": PROBE_THREADS,
    }


# -- printing ------------------------------------------------------------------------------------


def cell(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_measured(rows_by_count: dict[int, dict[str, float | None]]) -> None:
    counts = sorted(rows_by_count)
    print(
        f"{'ms':<13}" + "".join(f"{str(n) + (' node' if n == 1 else ' nodes'):>10}" for n in counts)
    )
    for title, names in (
        ("", PHASE_ROWS),
        ("made of:", PART_ROWS),
        ("CPU per node per cycle, ms; cores busy with this run, and with anything else:", CPU_ROWS),
    ):
        if title:
            print(title)
        for name in names:
            print(f"{name:<13}" + "".join(cell(rows_by_count[n][name], 10) for n in counts))


def print_fits(fits: dict[str, Fit], reached: dict[str, float | None]) -> None:
    """Per row: the line, the growth, the projections, and the target at 16 nodes."""
    head = "".join(f"{'@' + str(n):>9}" for n in PROJECT_TO)
    print(
        f"{'fit':<13}{'a ms':>8}{'b ms/n':>8}{'R2':>6}{'k':>6}  {'growth':<12}"
        f"{head}{'k@1024':>10}  {f'<={TARGET_MS:g}ms@{TARGET_NODES}':<12}"
    )
    for name, fit in fits.items():
        at_target = reached.get(name)
        verdict = (
            "-"
            if name not in TARGET_ROWS or at_target is None
            else ("ok" if at_target <= TARGET_MS else f"OVER {at_target:.1f}")
        )
        print(
            f"{name:<13}{cell(fit.a, 8)}{cell(fit.b, 8, 3)}{cell(fit.r2, 6)}{cell(fit.k, 6)}"
            f"  {fit.growth:<12}"
            + "".join(cell(fit.linear_at(n), 9, 1) for n in PROJECT_TO)
            + f"{cell(fit.power_at(PROJECT_TO[-1]), 10, 1)}  {verdict:<12}"
        )


def beat_ops_per_s(nodes: int) -> float:
    """Store requests the beats make job-wide: each node writes its record, checks that the
    records it reads exist and reads them in one multi_get (protocols/nodes.py `beat_once`)."""
    return nodes * 3 / BEAT_S


def records_per_beat(nodes: int) -> float:
    """Records the leader's store sends job-wide per beat: the leader reads every node's; a
    follower, on average, every node's one beat in `full_every` and two (the leader's, its own)
    on the others (protocols/nodes.py `NodeBeat.full_every`)."""
    whole = -(-nodes // FULL_READ_NODES)
    follower = (nodes + 2 * (whole - 1)) / whole
    return nodes + (nodes - 1) * follower


def beat_bytes_per_s(nodes: int, record_bytes: float = RECORD_BYTES) -> float:
    """Bytes of records the leader's store sends job-wide for the beats."""
    return records_per_beat(nodes) * record_bytes / BEAT_S


def fan_in_note(probe: dict[str, float] | None, largest: int) -> list[str]:
    """What one job store on the leader takes at 1,024 nodes: the rates from the code, the
    times from the probe."""
    n = 1024
    beat_ops = beat_ops_per_s(n)
    here = f" ({beat_ops_per_s(largest):,.0f}/s at {largest} nodes here)" if largest > 1 else ""
    lines = [
        f"At {n:,} nodes every node's beats, crossings and command polls go to one TCPStore, "
        "the leader's (one event loop):",
        f"- beats: every {BEAT_S:g} s each node writes its record, checks the ones it reads and "
        f"reads them in one multi_get: 3n/{BEAT_S:g} s = {beat_ops:,.0f} store requests/s "
        f"job-wide, linear{here}. The leader reads every record, a follower the leader's and its "
        f"own and every record one beat in {-(-n // FULL_READ_NODES)}: "
        f"{records_per_beat(n):,.0f} records x ~{RECORD_BYTES} B / {BEAT_S:g} s = "
        f"{beat_bytes_per_s(n) / 1e6:,.1f} MB/s out of the leader's store (every node reading "
        f"every record, as before: {n * n * RECORD_BYTES / BEAT_S / 1e6:,.0f} MB/s).",
        "- crossings (3 a step): each node reads the command counter, puts its value and counts "
        "itself in; the last to arrive reads the n values in one multi_get, folds them and wakes "
        "the others with the result in one multi_set; a woken node reads its wake; each deletes "
        f"its keys of two crossings before: ~7n requests ({7 * n:,}) and ~{n:,} values read "
        "job-wide, nothing polls.",
        f"- linear: each node polls the command counter every {COMMANDS_POLL_S:g} s "
        f"({n / COMMANDS_POLL_S:,.0f} ops/s at {n:,}: a crossing reads them too) and puts its "
        f"state at most every {NODES_PUBLISH_EVERY_S:g} s, a new lifecycle at once "
        f"({n / NODES_PUBLISH_EVERY_S:,.0f} ops/s).",
    ]
    if probe is None:
        return lines
    nodes = f"{probe['nodes']:,.0f}"
    rate = probe["reads_per_s"]
    return [
        *lines,
        f"- probe, {nodes} records on loopback, one client: a check {probe['check_ms']:.3f} ms, "
        f"a get {probe['get_ms']:.3f} ms; one node's beat "
        f"{probe['beat_ms']:.0f} ms of its {BEAT_S:g} s; the reads of every value at a "
        f"crossing one by one {probe['values_ms']:.0f} ms (every node, once), as the last "
        f"node's one multi_get {probe['multi_get_ms']:.1f} ms (now); "
        f"has_all {probe['has_all_ms']:.2f} ms. {probe['threads']:.0f} clients got "
        f"{rate:,.0f} gets/s ({2 * rate:,.0f} requests/s) from it on this VM.",
        f"- the requests are within reach: the beats ask {beat_ops:,.0f}/s of a store that "
        f"served {2 * rate:,.0f}/s here, and the leader's own beat reads {n:,} records.",
    ]


# -- main ----------------------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> tuple[list[CountRun], str]:
    """Run each node count in turn; stop at the first that cannot run or fails, saying why."""
    runs: list[CountRun] = []
    node_mb = NODE_MB_GUESS
    for nodes in args.nodes:
        layout = Layout(args.config, nodes, args.ranks_per_node, args.steps, args.peers)
        need_mb = layout.real_nodes * node_mb + args.floor_mb  # (the peers: one process)
        available = mem_available_mb()
        if available < need_mb:
            why = (
                f"stopped before {nodes} nodes: {available:.0f} MB available, {need_mb:.0f} MB "
                f"needed ({node_mb:.0f} MB a node, measured on the count before, + --floor-mb)"
            )
            return runs, why
        print(f"running {nodes} node(s) x {args.ranks_per_node} rank(s) ...", flush=True)
        run = run_count(layout, wall_s=args.wall_s, floor_mb=args.floor_mb)
        runs.append(run)
        print(
            f"  {run.outcome.status} in {run.run_s:.0f} s, {run.cpu_s:.0f} CPU s, "
            f"{run.used_mb:.0f} MB{' ' + run.outcome.why if run.outcome.why else ''}",
            flush=True,
        )
        if run.outcome.status != "ok":
            return runs, f"stopped at {nodes} nodes ({run.outcome.status}): {run.outcome.why}"
        if run.used_mb > 0:
            node_mb = max(run.used_mb / layout.real_nodes, 100.0)
    return runs, ""


def measured_rows(runs: list[CountRun]) -> dict[int, dict[str, float | None]]:
    """Every row of every node count that ran to the end."""
    return {
        run.nodes: {
            **summary_rows(run.summaries),
            **part_rows(run.records),
            **cpu_rows(run.cpu_samples, run.records),
        }
        for run in runs
        if run.outcome.status == "ok"
    }


def print_runs(runs: list[CountRun], stopped: str, asked: list[int]) -> None:
    """How each count went, and where the sweep stopped."""
    for run in runs:
        agree = nodes_agree(run.summaries) if len(run.summaries) > 1 else "-"
        print(
            f"{run.nodes:>3} nodes: {run.outcome.status} in {run.run_s:.0f} s (start-up "
            f"included: {run.cpu_s / max(run.run_s, 1e-9):.1f} cores busy), {run.used_mb:.0f} MB, "
            f"same weights on every node: {agree}, processes left: {len(run.leftovers)}"
        )
        waits = (run.peers or {}).get("wait_ms") or {}
        if waits.get("median") is not None:
            print(
                f"      the peers waited at a fence for the leader: median {waits['median']:.2f} "
                f"ms, p10 {waits['p10']:.2f} ms (about nothing: a peer came last)"
            )
    print(stopped or f"ran every count asked for ({' '.join(map(str, asked))})")


def run_json(run: CountRun, rows: dict[str, float | None] | None) -> dict[str, Any]:
    rows = rows or {}
    return {
        "nodes": run.nodes,
        "status": run.outcome.status,
        "why": run.outcome.why,
        "run_s": run.run_s,
        "run_cpu_s": run.cpu_s,  # the whole run's, start-up included
        "used_mb": run.used_mb,
        "leftover_pids": run.leftovers,
        "nodes_agree": nodes_agree(run.summaries) if len(run.summaries) > 1 else None,
        "peers": run.peers,
        "median_ms": {name: rows.get(name) for name in (*PHASE_ROWS, *PART_ROWS)},
        "cpu": {name: rows.get(name) for name in CPU_ROWS},
    }


def fits_json(fits: dict[str, Fit]) -> dict[str, Any]:
    return {
        name: {
            **vars(fit),
            "linear_ms": {str(n): fit.linear_at(n) for n in PROJECT_TO},
            "power_ms": {str(n): fit.power_at(n) for n in PROJECT_TO},
        }
        for name, fit in fits.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--wall-s", type=float, default=600.0, help="per node count")
    parser.add_argument("--floor-mb", type=float, default=2048.0, help="memory kept free")
    parser.add_argument("--probe-nodes", type=int, default=1024, help="0: no store probe")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="one real node (the leader) and n-1 protocol peers (benchmarks/peers.py)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.monotonic()
    runs, stopped = sweep(args)
    rows_by_count = measured_rows(runs)
    fits = fit_all(rows_by_count)
    probe = store_probe(args.probe_nodes) if args.probe_nodes else None
    note = fan_in_note(probe, max(rows_by_count, default=0))
    print(
        f"\none job of simulated engines, {args.ranks_per_node} rank(s) per node, "
        f"{args.steps} steps; ms, the slowest node's, median over steps 2..{args.steps}"
    )
    if args.peers:
        print(
            "nodes 1..n-1 are protocol peers (benchmarks/peers.py: beats, crossings, state, "
            "command polls, no workers): the figures are the leader's, a whole node; the peers' "
            "CPU is in `other cores`"
        )
    if rows_by_count:
        print_measured(rows_by_count)
        print()
        print_fits(fits, rows_by_count.get(TARGET_NODES, {}))
        print(
            "(a + b*n: least squares; k: the exponent of the rise over the smallest count on "
            f"log-log, 1 linear, 2 quadratic; flat: rises < {FLAT_MS:g} ms; @n: the line's "
            "projection; k@1024: the power law's; crossings fitted from 2 nodes)"
        )
    print_runs(runs, stopped, args.nodes)
    print("\n" + "\n".join(note))
    total_s = time.monotonic() - started
    print(f"\nthe whole benchmark: {total_s:.0f} s")
    if args.json:
        result = {
            "config": str(args.config),
            "steps": args.steps,
            "ranks_per_node": args.ranks_per_node,
            "peers": args.peers,
            "nodes_asked": args.nodes,
            "deadlines_env": UNDER_LOAD,
            "target_ms": TARGET_MS,
            "runs": [run_json(run, rows_by_count.get(run.nodes)) for run in runs],
            "stopped": stopped or None,
            "fits": fits_json(fits),
            "probe": probe,
            "fan_in_note": note,
            "total_s": total_s,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
