"""Seeing a run: its trace, picture, table and TensorBoard scalars, from a real `timeshare run`
(the reference engine, two ranks) and read back as a user would."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
from matplotlib.colors import to_hex
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.daemon.test_run import FinishedRun, finished_run
from tests.report.trace_format import Event, check_events, check_timeline, load_trace, ns
from timeshare.cycle.steps import PHASES
from timeshare.protocols.commands.results import ROLES
from timeshare.report import picture
from timeshare.report.run_dir import RunDir
from timeshare.report.scalars import scalars_of
from timeshare.report.summary import read_summary
from timeshare.report.trace import BARRIER_WAIT, DRIVER_TID, track_of

STEPS = 4


@pytest.fixture(scope="module")
def run() -> Iterator[FinishedRun]:
    inside = {"tensorboard": "tensorboard", "trace": "trace.json"}
    with finished_run(STEPS, inside) as finished:
        assert finished.done.returncode == 0, finished.done.stderr
        yield finished


def timeshare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeshare", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def slices_of(events: list[Event], tid: int) -> list[Event]:
    return [e for e in events if e["ph"] == "X" and e["tid"] == tid]


def phase_slices(events: list[Event]) -> dict[tuple[int, str, str, int], Event]:
    """(rank, role, phase, step) -> its phase slice."""
    found: dict[tuple[int, str, str, int], Event] = {}
    for rank in (0, 1):
        for role in ROLES:
            for event in slices_of(events, track_of(rank, role)):
                if event["cat"] == "phase":
                    key = (rank, role, event["name"].lower(), event["args"]["step"])
                    assert key not in found, f"{key} twice"
                    found[key] = event
    return found


@pytest.mark.slow
def test_the_trace_has_every_phase_of_every_rank_and_step_as_long_as_the_summary_says(
    run: FinishedRun,
) -> None:
    assert f"trace in {run.trace}" in run.done.stdout
    events = load_trace(run.trace)  # whole: the run closed it
    check_events(events)
    check_timeline(events)  # nested, never half over, timestamps never back on a track
    slices = phase_slices(events)
    for figures in run.steps():
        for rank_figures in figures.per_rank:
            for role in ROLES:
                for phase in PHASES:
                    event = slices[(rank_figures.rank, role, phase, figures.step)]
                    summary_ns = round(rank_figures.phases[phase] * 1e9)
                    assert abs(ns(event["dur"]) - summary_ns) <= 1_000_000, (figures.step, phase)
                    assert event["args"]["version"] == figures.step
    # Step 0 is the bootstrap: the first weights go out, and the first rollout samples them.
    assert {(p, s) for (_, _, p, s) in slices if s == 0} == {
        ("sync", 0), ("barrier", 0), ("resume", 0), ("rollout", 0)
    }  # fmt: skip


@pytest.mark.slow
def test_each_phase_holds_what_its_workers_did(run: FinishedRun) -> None:
    events = load_trace(run.trace)
    step = 2
    for rank in (0, 1):
        inside = defaultdict(set)  # (role, phase) -> names of the slices within it
        for role in ROLES:
            timeline = slices_of(events, track_of(rank, role))
            phases = [e for e in timeline if e["cat"] == "phase" and e["args"]["step"] == step]
            for phase in phases:
                start, end = ns(phase["ts"]), ns(phase["ts"]) + ns(phase["dur"])
                inside[(role, phase["name"])] = {
                    e["name"]
                    for e in timeline
                    if e["cat"] != "phase" and start <= ns(e["ts"]) < end
                }
        buckets = int(phases_args(events, rank, "SYNC", step)["trainer.buckets"])
        assert inside[("trainer", "TRAIN")] == {"train"}
        assert inside[("trainer", "SYNC")] == {
            "sync", "prepare", "send", "offload params", "finalize",
            *(f"pack {i}" for i in range(buckets)), *(f"ACK {i}" for i in range(buckets)),
        }  # fmt: skip
        assert inside[("rollout", "SYNC")] == {
            "sync", "wake weights", "receive", "finalize", *(f"load {i}" for i in range(buckets))
        }  # fmt: skip
        assert inside[("trainer", "BARRIER")] == {"barrier", BARRIER_WAIT}
        assert inside[("rollout", "RESUME")] == {"resume", "wake kv_cache"}
        assert inside[("rollout", "ROLLOUT")] == {"rollout", "generate", "score", "sleep"}


def phases_args(events: list[Event], rank: int, name: str, step: int) -> dict[str, Any]:
    (event,) = [
        e
        for e in slices_of(events, track_of(rank, "trainer"))
        if e["name"] == name and e["args"]["step"] == step
    ]
    args: dict[str, Any] = event["args"]
    return args


@pytest.mark.slow
def test_the_drivers_track_shows_the_fences_and_the_lifecycle(run: FinishedRun) -> None:
    events = load_trace(run.trace)
    marks = [e for e in events if e["ph"] == "i"]
    assert all(e["tid"] == DRIVER_TID for e in marks)
    names = [e["name"] for e in marks]
    assert names[0] == "running" and names[-1] == "stopped"
    for fence in ("fence before SYNC", "fence before RESUME", "fence before TRAIN"):
        assert names.count(fence) >= STEPS, fence
    # The fence before step 2's TRAIN comes after every rank's step-1 ROLLOUT ended.
    train_fence = next(
        e for e in marks if e["name"] == "fence before TRAIN" and e["args"]["step"] == 2
    )
    rollouts = [e for e in events if e["name"] == "ROLLOUT" and e["args"]["step"] == 1]
    assert len(rollouts) == 4
    assert all(ns(e["ts"]) + ns(e["dur"]) <= ns(train_fence["ts"]) for e in rollouts)


@pytest.mark.slow
def test_the_trace_rebuilt_from_the_log_is_the_same_file(run: FinishedRun, tmp_path: Path) -> None:
    rebuilt = tmp_path / "rebuilt.json"
    done = timeshare("trace", str(run.root), "--out", str(rebuilt))
    assert done.returncode == 0, done.stderr
    assert f"{rebuilt} (" in done.stdout and "ui.perfetto.dev" in done.stdout
    assert rebuilt.read_bytes() == run.trace.read_bytes()
    # By default beside the live trace, never over it (a run may still be writing that one).
    beside = timeshare("trace", str(run.root))
    assert beside.returncode == 0, beside.stderr
    assert (run.root / "trace-from-log.json").read_bytes() == run.trace.read_bytes()


@pytest.mark.slow
def test_the_picture_has_its_four_panels_readable_at_a_glance(
    run: FinishedRun, tmp_path: Path
) -> None:
    run_dir = RunDir.at(run.root)
    drawn = picture.figure(run_dir.summary(), run_dir.records(), gantt_steps=2)
    assert drawn.get_suptitle() == f"job: 2 ranks, steps 1-{STEPS} ({STEPS})"
    panels = {axes.get_label(): axes for axes in drawn.axes}
    assert set(panels) == set(picture.PANELS)
    gantt = panels["timeline"]
    rows = [label.get_text() for label in gantt.get_yticklabels()]
    assert rows == ["rank 0 rollout", "rank 0 trainer", "rank 1 rollout", "rank 1 trainer"]
    assert gantt.get_xlabel() == "seconds since the first phase shown"
    assert gantt.get_title().startswith(f"steps {STEPS - 1}-{STEPS}:")
    # Every phase of the two steps shown, on each row: a light band and the worker's own work.
    colours = {to_hex(numpy.asarray(bar.get_facecolor())[0]) for bar in gantt.collections}
    assert len(gantt.collections) == 2 * 4 * 6 * 2
    assert len(colours) == 6
    legend = gantt.get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == PHASES
    stacked = panels["step time"]
    assert (stacked.get_xlabel(), stacked.get_ylabel()) == ("step", "seconds")
    assert len(stacked.patches) == STEPS * len(PHASES)  # a bar per phase per step
    assert stacked.get_legend() is not None
    reward, sync = panels["reward"], panels["sync"]
    assert reward.get_ylabel() == "mean reward" and sync.get_ylabel() == "GB/s"
    assert numpy.asarray(reward.lines[0].get_xdata()).tolist() == list(range(1, STEPS + 1))
    gbps = [figures.sync.gbps for figures in run.steps()]
    assert numpy.asarray(sync.lines[0].get_ydata()).tolist() == gbps

    done = timeshare("report", str(run.root), "--out", str(tmp_path / "report.png"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"timeshare report: {tmp_path / 'report.png'}"
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_picture_needs_the_log_and_a_png_to_write(run: FinishedRun, tmp_path: Path) -> None:
    shutil.copy(run.root / "summary.json", tmp_path)
    no_log = timeshare("report", str(tmp_path))
    assert no_log.returncode == 2 and "holds no log.jsonl" in no_log.stderr
    assert timeshare("report", str(tmp_path), "--text").returncode == 0  # the table needs none
    pdf = timeshare("report", str(run.root), "--out", str(tmp_path / "report.pdf"))
    assert pdf.returncode == 2 and "name it *.png" in pdf.stderr
    unwritable = timeshare("report", str(run.root), "--out", "/proc/report.png")
    assert unwritable.returncode == 2 and "--out /proc/report.png: cannot write it" in (
        unwritable.stderr
    )
    steps = timeshare("report", str(run.root), "--steps", "0")
    assert steps.returncode == 2 and "--steps must be at least 1" in steps.stderr


def nearest_rank_p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


@pytest.mark.slow
def test_the_text_report_is_the_runs_per_phase_table(run: FinishedRun) -> None:
    done = timeshare("report", str(run.root), "--text")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{run.root}: steps 1-{STEPS} ({STEPS}), 2 ranks"
    steps = run.steps()
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:9]}
    for phase in (*PHASES, "step"):
        seconds = [s.step_s if phase == "step" else s.phases[phase] for s in steps]
        expected = [statistics.median(seconds), nearest_rank_p90(seconds), max(seconds)]
        assert rows[phase] == pytest.approx([v * 1e3 for v in expected], abs=0.051), phase
    rates = [s.sync.gbps for s in steps]
    assert lines[9] == (
        f"sync     {statistics.median(rates):.3f} GB/s median, "
        f"{nearest_rank_p90(rates):.3f} p90, {max(rates):.3f} max"
    )
    bubble = 100 * sum(s.bubble_s for s in steps) / sum(s.step_s for s in steps)
    assert lines[10] == f"bubble   {bubble:.1f} % of the step time"
    largest = max(s.logprob_max_abs_diff for s in steps if s.logprob_max_abs_diff is not None)
    lengths = [s.lengths for s in steps if s.lengths is not None]
    assert len(lengths) == STEPS
    means = [m.completion_tokens_mean for m in lengths]
    truncated = [m.truncated_fraction for m in lengths]
    padding = [m.padding_share for m in lengths]
    assert lines[11:] == [
        f"logprobs trainer/rollout differ by {largest:.1e} at most",
        f"completion {statistics.median(means):.1f} tokens median of the steps' means, "
        f"{max(means):.1f} max",
        f"truncated {statistics.median(truncated):.0%} median, {max(truncated):.0%} max; "
        f"padding {statistics.median(padding):.0%} of TRAIN's tokens median",
    ]


@pytest.mark.slow
def test_the_report_reads_older_summaries_and_skips_a_line_cut_short(
    run: FinishedRun, tmp_path: Path
) -> None:
    """The summary was one JSON object rewritten every step; it is now a line per step. Both
    give the same table, and so does a file whose last line a crash cut short."""
    data = read_summary(run.root / "summary.json")
    older, cut = tmp_path / "older", tmp_path / "cut"
    older.mkdir()
    cut.mkdir()
    legacy = {"config": data.config, "ranks": data.ranks, "steps": data.steps}
    (older / "summary.json").write_text(json.dumps(legacy, indent=1))
    text = (run.root / "summary.json").read_text()
    (cut / "summary.json").write_text(text + '{"step": 5, "per_ra')
    tables = [timeshare("report", str(d), "--text") for d in (run.root, older, cut)]
    assert [t.returncode for t in tables] == [0, 0, 0], [t.stderr for t in tables]
    bodies = {"\n".join(t.stdout.splitlines()[1:]) for t in tables}
    assert len(bodies) == 1 and f"steps 1-{STEPS} ({STEPS})" in tables[1].stdout


@pytest.mark.slow
def test_the_timeline_is_read_across_the_logs_rotated_generations(
    run: FinishedRun, tmp_path: Path
) -> None:
    lines = (run.root / "log.jsonl").read_text().splitlines(keepends=True)
    third = len(lines) // 3
    for name, part in (
        ("log.jsonl.2", lines[:third]),
        ("log.jsonl.1", lines[third : 2 * third]),
        ("log.jsonl", lines[2 * third :]),
    ):
        (tmp_path / name).write_text("".join(part))
    assert RunDir.at(tmp_path).records() == RunDir.at(run.root).records()


@pytest.mark.slow
def test_tensorboard_holds_every_scalar_of_every_step(run: FinishedRun) -> None:
    accumulator = EventAccumulator(str(run.root / "tensorboard"))
    accumulator.Reload()  # TensorBoard's own reader
    steps = run.steps()
    expected = {step.step: scalars_of(step) for step in steps}
    tags = set(accumulator.Tags()["scalars"])
    assert tags == set(expected[1]), tags
    assert {"reward", "phase_s/sync", "sync/gbps", "memory/held_at_barrier_mb"} <= tags
    lengths = {"completion/tokens_mean", "completion/truncated_fraction", "train/padding_share"}
    assert lengths <= tags
    for tag in tags:
        points = {event.step: event.value for event in accumulator.Scalars(tag)}
        assert sorted(points) == list(range(1, STEPS + 1)), tag
        for step, value in points.items():
            assert value == pytest.approx(expected[step][tag], rel=1e-6), (tag, step)
    assert all(step.held_at_barrier_mb == 0.0 and step.weights_match for step in steps)


@pytest.mark.parametrize("command", [["report", "--text"], ["report"], ["trace"]])
def test_a_run_dir_that_is_missing_is_exit_2_naming_it(tmp_path: Path, command: list[str]) -> None:
    missing = timeshare(command[0], str(tmp_path / "nope"), *command[1:])
    assert missing.returncode == 2
    assert f"{tmp_path / 'nope'}: no such run directory" in missing.stderr


def test_a_run_dir_without_a_summary_or_a_log_is_exit_2_naming_what_is_missing(
    tmp_path: Path,
) -> None:
    empty = timeshare("report", str(tmp_path), "--text")
    assert empty.returncode == 2 and "holds no summary.json" in empty.stderr
    (tmp_path / "summary.json").write_text('{"ranks": 2, "steps": []}')
    none = timeshare("report", str(tmp_path), "--text")
    assert none.returncode == 2 and "finished no step yet" in none.stderr
    (tmp_path / "summary.json").write_text("{not json")
    broken = timeshare("report", str(tmp_path), "--text")
    assert broken.returncode == 2 and "not a run's summary" in broken.stderr

    no_log = timeshare("trace", str(tmp_path))
    assert no_log.returncode == 2 and "holds no log.jsonl" in no_log.stderr
    # A log of a run whose level kept the cycle's records out (or that ended no phase).
    (tmp_path / "log.jsonl").write_text('{"event": "cycle.run.stopped"}\n{cut sho')
    quiet = timeshare("trace", str(tmp_path))
    assert quiet.returncode == 2 and "no phase of the run is in it" in quiet.stderr
    (tmp_path / "log.jsonl").write_text('{"event": "cycle.phase.ended", "record": {"rank": 0}}\n')
    garbled = timeshare("trace", str(tmp_path))
    assert garbled.returncode == 2 and "log.jsonl:1: a record of the timeline" in garbled.stderr
    assert not (tmp_path / "trace.json").exists()


@pytest.mark.slow
def test_reading_a_run_imports_no_torch(run: FinishedRun, tmp_path: Path) -> None:
    """`timeshare report` (the table and the picture) and `timeshare trace` read a run's files
    (its summary.json and log.jsonl, as `timeshare run` wrote them): torch's import (seconds on
    a loaded machine) is not theirs to pay. Each reads the run through, to its output."""
    shutil.copy(run.root / "summary.json", tmp_path)
    shutil.copy(run.root / "log.jsonl", tmp_path)
    png, trace_file = tmp_path / "report.png", tmp_path / "rebuilt.json"
    probe = (
        "import sys; from timeshare.daemon import cli; "
        "from timeshare.report import picture, run_dir, table, trace; "
        "codes = [cli.main(['report', sys.argv[1], '--text']), "
        "cli.main(['report', sys.argv[1], '--out', sys.argv[2]]), "
        "cli.main(['trace', sys.argv[1], '--out', sys.argv[3]])]; "
        "print(codes, [m for m in ('torch', 'torch.distributed') if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path), str(png), str(trace_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == f"{tmp_path}: steps 1-{STEPS} ({STEPS}), 2 ranks", done.stderr
    assert lines[-1] == "[0, 0, 0] []", done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert trace_file.read_bytes() == run.trace.read_bytes()
