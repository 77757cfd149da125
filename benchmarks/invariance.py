"""What `[engine] batch_invariant` costs and buys: the demo's job with the switch off and on.

    python benchmarks/invariance.py --steps 10 --rounds 2 --json runs/invariance.json
    python benchmarks/invariance.py --pairs --steps 5 --json runs/invariance-pairs.json

Each round runs `timeshare run examples/tiny-grpo.toml` (two ranks, the reference trainer and
rollout) for `--steps` steps, once with the switch off and once on, alternating. Per setting it
prints the median step time and the TRAIN and ROLLOUT phases' (the slowest rank's, from the
summary), the largest trainer/rollout logprob difference of any step, and the reward of the
first and last step. The first step is left out of the times (start-up).

`--pairs`: each trainer x rollout pair of the examples (vLLM and SGLang's from their venvs'
Python) for `--steps` steps with the switch off, then on: the largest logprob difference of any
step, or why the switch was refused (exit 2: the engine or platform has no such mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "tiny-grpo.toml"


# (trainer, rollout, example, the Python that runs it): an SGLang job runs from SGLang's venv
PAIRS = [
    ("torch_ref", "torch_ref", "tiny-grpo.toml", ".venv"),
    ("fsdp", "torch_ref", "fsdp-grpo.toml", ".venv"),
    ("megatron (TP 2)", "torch_ref", "megatron-grpo.toml", ".venv"),
    ("megatron (TP 1)", "torch_ref", "megatron-grpo.toml", ".venv"),
    ("torch_ref", "vllm", "vllm-grpo.toml", ".venv"),
    ("fsdp", "vllm", "fsdp-vllm-grpo.toml", ".venv"),
    ("megatron (TP 2)", "vllm", "megatron-vllm-grpo.toml", ".venv"),
    ("torch_ref", "sglang", "sglang-grpo.toml", ".venv-sglang"),
]
# The model the FSDP and Megatron examples start from (the Makefile's FSDP_MODEL)
MODEL_INIT = (
    "--layers 2 --hidden 192 --intermediate 384 --heads 6 --kv-heads 6 --vocab 16 "
    "--max-positions 64 --seed 0"
)


class Refused(Exception):
    """The run ended with exit 2: its config was refused (what it said)."""


def run(
    steps: int,
    on: bool,
    *,
    job: Path = JOB,
    python: str = sys.executable,
    trainer: str = "",
    tensor_parallel: str = "",
) -> list[dict[str, Any]]:
    """One run of `job`; its summary's steps. An FSDP or Megatron `trainer` starts from a model
    made now; Megatron's `tensor_parallel` size, where given."""
    with tempfile.TemporaryDirectory(prefix="ts-inv-", dir="/tmp") as scratch:
        model_key: dict[str, str] = {}
        if trainer in ("fsdp", "megatron"):
            model = Path(scratch) / "model"
            init = [python, "-m", "timeshare", "model", "init", *MODEL_INIT.split(), str(model)]
            subprocess.run(init, capture_output=True, check=True, timeout=300, cwd=ROOT)
            model_key[f"TIMESHARE_ENGINE__{trainer.upper()}__MODEL_DIR"] = str(model)
        if tensor_parallel:
            model_key["TIMESHARE_ENGINE__MEGATRON__TENSOR_PARALLEL_SIZE"] = tensor_parallel
        env = {
            **os.environ,
            **model_key,
            "TIMESHARE_JOB__STEPS": str(steps),
            "TIMESHARE_JOB__RUNTIME_DIR": f"{scratch}/run",
            "TIMESHARE_JOB__CHECKPOINT_DIR": f"{scratch}/checkpoints",
            "TIMESHARE_LOG__FILE": f"{scratch}/log.jsonl",
            "TIMESHARE_LOG__TRACE": "",
            "TIMESHARE_ENGINE__BATCH_INVARIANT": "true" if on else "false",
        }
        summary = Path(scratch) / "summary.json"
        argv = [python, "-m", "timeshare", "run", str(job), "--summary", str(summary)]
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=1800, check=False, cwd=ROOT
        )
        if done.returncode == 2:
            raise Refused(done.stderr.strip().splitlines()[-1])
        if done.returncode != 0:
            raise SystemExit(f"the run failed ({done.returncode}): {done.stderr[-2000:]}")
        from timeshare.report.summary import read_summary

        return read_summary(summary).steps


def figures(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    later = [step for steps in runs for step in steps[1:]]
    return {
        "step_s": statistics.median(s["step_s"] for s in later),
        "train_s": statistics.median(s["phases"]["train"] for s in later),
        "rollout_s": statistics.median(s["phases"]["rollout"] for s in later),
        "logprob_max_abs_diff": max(s["logprob_max_abs_diff"] for steps in runs for s in steps),
        "reward_first": statistics.mean(steps[0]["reward_mean"] for steps in runs),
        "reward_last": statistics.mean(steps[-1]["reward_mean"] for steps in runs),
    }


def pairs(steps: int) -> list[dict[str, Any]]:
    """Each pair of the examples, off and on: the largest logprob difference, or the refusal."""
    rows = []
    for trainer, rollout, example, venv in PAIRS:
        row: dict[str, Any] = {"trainer": trainer, "rollout": rollout, "example": example}
        python = str(ROOT / venv / "bin" / "python")
        for setting in ("off", "on"):
            try:
                job = ROOT / "examples" / example
                tp = trainer.removesuffix(")").split("TP ")[-1] if "TP" in trainer else ""
                kind = trainer.split()[0]
                done = run(
                    steps, setting == "on", job=job, python=python, trainer=kind, tensor_parallel=tp
                )
            except Refused as refused:
                row[setting] = str(refused)
            else:
                row[setting] = max(step["logprob_max_abs_diff"] for step in done)
        print(f"{trainer:<16} {rollout:<10} off {row['off']!s:<24} on {row['on']}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pairs", action="store_true", help="every pair of the examples")
    args = parser.parse_args()
    if args.pairs:
        rows = pairs(args.steps)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"steps": args.steps, "pairs": rows}, indent=2))
        return
    runs: dict[str, list[list[dict[str, Any]]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for setting, done in runs.items():
            done.append(run(args.steps, setting == "on"))
    table = {setting: figures(done) for setting, done in runs.items()}
    header = f"{'switch':<7} {'step s':>7} {'train s':>8} {'rollout s':>10} {'logprob diff':>13}"
    print(f"{header} reward")
    for setting, row in table.items():
        print(
            f"{setting:<7} {row['step_s']:>7.3f} {row['train_s']:>8.3f} {row['rollout_s']:>10.3f} "
            f"{row['logprob_max_abs_diff']:>13.2e} {row['reward_first']:.3f} -> "
            f"{row['reward_last']:.3f}"
        )
    cost = table["on"]["step_s"] / table["off"]["step_s"]
    print(f"the switch costs {cost:.2f}x the step time ({args.steps} steps x {args.rounds} rounds)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"steps": args.steps, "rounds": args.rounds, "table": table, "cost": cost}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
