"""`timeshare run` with the reference engine: real processes end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.configs import FAST, TINY, toml_file
from tests.cycle.jobs import assert_nothing_left
from timeshare.cycle.records import PhaseRecord
from timeshare.cycle.steps import StepFigures
from timeshare.report.run_dir import RunDir
from timeshare.report.summary import read_summary
from timeshare.rotating import rotated_paths


def write_config(
    root: Path,
    steps: int,
    log: dict[str, Any] | None = None,
    job: dict[str, Any] | None = None,
    **sections: Any,
) -> Path:
    """The reference engine at its smallest, logging to `root`/log.jsonl (and `log` besides)."""
    log = {"file": f"{root}/log.jsonl", **(log or {})}
    return toml_file(root, TINY, job={"steps": steps, **(job or {})}, log=log, **sections)


def timeshare_run(
    config: Path, summary: Path, timeout_s: float = 150.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeshare", "run", str(config), "--summary", str(summary)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def steps_of(summary: Path) -> list[dict[str, Any]]:
    if not summary.exists():
        return []
    return read_summary(summary).steps


@dataclass(frozen=True)
class FinishedRun:
    """A run that went to its end in `root`, where it wrote its summary, its log and whatever
    else its config asked for: shared by the tests that read it."""

    root: Path
    done: subprocess.CompletedProcess[str]

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def trace(self) -> Path:
        return self.root / "trace.json"

    def steps(self) -> list[StepFigures]:
        return msgspec.convert(steps_of(self.summary), list[StepFigures])


@contextmanager
def finished_run(
    steps: int, inside: dict[str, str] | None = None, job: dict[str, Any] | None = None
) -> Iterator[FinishedRun]:
    """Run `steps` steps in a directory of their own; `inside`: more [log] keys, each naming a
    path inside that directory; `job`: more [job] keys."""
    root = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # short: ipc paths are bounded
    try:
        log = {key: f"{root}/{name}" for key, name in (inside or {}).items()}
        config = write_config(root, steps=steps, log=log, job=job)
        yield FinishedRun(root, timeshare_run(config, root / "summary.json"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def five_steps() -> Iterator[FinishedRun]:
    with finished_run(5, job={"keep_checkpoints": 1}) as run:
        yield run


@pytest.mark.slow
def test_a_run_writes_every_figure_of_every_step(five_steps: FinishedRun) -> None:
    done, root = five_steps.done, five_steps.root
    assert done.returncode == 0, done.stderr
    assert "stopped at step 5" in done.stdout
    for rank in (0, 1):  # [job] keep_checkpoints = 1: step 5, and the one a rank may be ahead
        kept = sorted(p.name for p in (root / "checkpoints" / f"rank{rank}").iterdir())
        assert kept == ["step-00000004", "step-00000005"]
    data = read_summary(five_steps.summary)
    assert data.ranks == 2
    steps = data.steps
    # One line per step, appended: the file is never rewritten as steps end
    lines = five_steps.summary.read_text().splitlines()
    assert [json.loads(line).get("step") for line in lines] == [None, 1, 2, 3, 4, 5]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    for entry in steps:
        assert entry["weight_version"] == entry["step"]
        assert entry["sample_version"] == entry["step"] - 1  # on policy
        assert entry["weights_match"] and entry["ranks_agree"]
        assert entry["logprob_max_abs_diff"] < 1e-4
        assert 0.0 <= entry["reward_mean"] <= 1.0
        assert set(entry["phases"]) == {"train", "offload", "sync", "barrier", "resume", "rollout"}
        assert [r["rank"] for r in entry["per_rank"]] == [0, 1]
        assert 0.0 <= entry["bubble_s"] < entry["step_s"]
        assert entry["sync"]["bytes"] > 0 and entry["sync"]["gbps"] > 0
        assert entry["committed_step"] == entry["step"]
    events = [json.loads(line) for line in (root / "log.jsonl").read_text().splitlines()]
    assert {e.get("role") for e in events} >= {"trainer", "rollout"}
    assert any(e["event"] == "trainer.offload" and e["freed_mb"] > 0 for e in events)
    assert_nothing_left(root)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["rollout", "sync"])
def test_a_rollout_killed_mid_phase_stops_the_run_naming_it(runtime_dir: Path, phase: str) -> None:
    fault = {"role": "rollout", "rank": 1, "phase": phase, "kind": "kill", "step": 2}
    summary = runtime_dir / "summary.json"
    started = time.monotonic()
    done = timeshare_run(write_config(runtime_dir, steps=4, faults=[fault]), summary)
    assert done.returncode == 1, done.stderr
    assert f"rollout rank 1 failed in phase {phase}" in done.stderr
    assert "WorkerDied" in done.stderr
    assert time.monotonic() - started < 90.0
    assert [s["step"] for s in steps_of(summary)] == [1]  # step 2 never completed
    assert_nothing_left(runtime_dir)


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_committed_step(
    runtime_dir: Path, five_steps: FinishedRun
) -> None:
    # The same job uninterrupted, for the reward curve the resumed run must continue.
    assert five_steps.done.returncode == 0, five_steps.done.stderr
    expected = [(s["step"], s["reward_mean"]) for s in steps_of(five_steps.summary)]

    # Killed at the worst moment: step 3's TRAIN is committed on every rank, its ROLLOUT hangs.
    hang = {"role": "rollout", "rank": 0, "phase": "rollout", "kind": "hang", "step": 3}
    summary = runtime_dir / "summary.json"
    argv = [
        sys.executable,
        "-m",
        "timeshare",
        "run",
        str(write_config(runtime_dir, 5, faults=[hang])),
    ]
    first = subprocess.Popen(
        [*argv, "--summary", str(summary)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    committed = [runtime_dir / "checkpoints" / f"rank{r}" / "step-00000003" for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(c.exists() for c in committed) and time.monotonic() < deadline:
        assert first.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    before = steps_of(summary)
    assert [s["step"] for s in before] == [1, 2]

    done = timeshare_run(write_config(runtime_dir, steps=5), summary)  # the fault removed
    assert done.returncode == 0, done.stderr
    assert "(2 steps this run)" in done.stdout  # resumed at the committed step 3
    steps = steps_of(summary)
    assert steps[:2] == before  # what the killed run wrote stays as it was
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]  # no committed step twice, none lost
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(set(versions))
    assert [(s["step"], s["reward_mean"]) for s in steps] == expected  # the same reward curve
    assert [s["step"] for s in steps if s["resumed"]] == [3]  # finished from the checkpoint
    assert all(s["weights_match"] and s["logprob_max_abs_diff"] < 1e-4 for s in steps)
    assert_nothing_left(runtime_dir)


def test_a_bad_config_is_one_line_and_exit_2(runtime_dir: Path) -> None:
    config = write_config(runtime_dir, steps=2, engine={"torch_ref": {"modle": {"x": 1}}})
    done = timeshare_run(config, runtime_dir / "summary.json", timeout_s=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "engine.torch_ref.modle" in done.stderr
    assert not (runtime_dir / "run").exists()


@pytest.mark.parametrize("on_mismatch", ["fail", "warn"])
def test_a_rollout_holding_other_weights_fails_the_run_or_warns(
    runtime_dir: Path, on_mismatch: str
) -> None:
    """Rank 1's simulated rollout really loads other weights from version 2 on (one value of a
    tensor changed after loading): "fail" ends the run at step 2's SYNC naming it, exit 1,
    before any sample is drawn from them, what the summary holds kept; "warn" runs on,
    weights_match false, a warning each such step. (The simulated trainer keeps no checkpoints:
    a failed run keeps its committed steps, test_a_killed_run_resumes_from_its_committed_step.)"""
    log = runtime_dir / "log.jsonl"
    config = toml_file(
        runtime_dir,
        FAST,
        job={"ranks": 2, "steps": 3},
        log={"file": str(log)},
        engine={"simulated": {"corrupt_weights": {"1": 2}}},
        checks={"on_weights_mismatch": on_mismatch},
    )
    summary = runtime_dir / "summary.json"
    done = timeshare_run(config, summary, timeout_s=90)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    if on_mismatch == "fail":
        assert done.returncode == 1, done.stderr
        failed = "rollout rank 1 failed in phase sync: WeightsMismatch: rollout rank 1: "
        assert f"{failed}the engine holds xxh3-128:" in done.stderr
        # Named by comparing both sides' per-tensor lines: the last of four tensors was altered.
        tensor = "the first tensor that differs: layer3.weight (torch.float32, shape ("
        assert f"{tensor}" in done.stderr and "): its bytes differ" in done.stderr
        assert [(s["step"], s["weights_match"]) for s in steps_of(summary)] == [(1, True)]
        phases = [e["record"] for e in events if e["event"] == "cycle.phase.ended"]
        rollouts = {p["step"] for p in phases if p["phase"] == "rollout"}
        assert rollouts == {0, 1}  # none drawn from the other weights
    else:
        assert done.returncode == 0, done.stderr
        assert [(s["step"], s["weights_match"]) for s in steps_of(summary)] == [
            (1, True),
            (2, False),
            (3, False),
        ]
        warned = [e for e in events if e["event"] == "cycle.weights.mismatch"]
        assert [(e["level"], e["step"], e["rank"]) for e in warned] == [
            ("warning", 2, 1),
            ("warning", 3, 1),
        ]
        assert all("layer3.weight" in e["error"] for e in warned)
    assert_nothing_left(runtime_dir)


def test_log_rotation_keys_reach_the_front_and_every_worker(runtime_dir: Path) -> None:
    """[log] max_mb and keep: the front and the workers all write the one log, rotated at the
    size asked, and what they wrote is read back across the generations."""
    log = runtime_dir / "log.jsonl"
    rotation = {"file": str(log), "max_mb": 0.004, "keep": 500}
    config = toml_file(runtime_dir, FAST, job={"steps": 3}, log=rotation)
    done = timeshare_run(config, runtime_dir / "summary.json")
    assert done.returncode == 0, done.stderr
    files = rotated_paths(log)
    assert len(files) > 3
    roles = set()
    for file in files:
        assert file.stat().st_size < 4096 + 4096  # the size, and the lines past it at once
        roles |= {json.loads(line).get("role") for line in file.read_text().splitlines()}
    assert {None, "trainer", "rollout"} <= roles  # the front's own lines, and the workers'
    phases = [r for r in RunDir.at(runtime_dir).records() if isinstance(r, PhaseRecord)]
    assert len(phases) == len({(r.rank, r.phase, r.step) for r in phases}) > 3 * 6
