"""Step time of the examples, per engine, from one source tree or another (before/after a change).

    python benchmarks/step_time.py --steps 8 --json runs/step_time.json
    python benchmarks/step_time.py --tree /tmp/old --steps 8 --json runs/step_time-old.json

Each example (`--examples`, default: one per trainer and rollout engine) runs for `--steps`
steps with `timeshare run` from `--tree` (its package first on the path, its own example file
and model init), with the Python of the venv the Makefile gives it. Per example it prints the
median step time and the TRAIN and ROLLOUT phases' (the slowest rank's, from the summary; the
first step is left out: start-up), the reward of the first and last step, whether every step's
weights matched, and where the summary has them the completions' mean length, truncated share
and TRAIN's padding share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# (example, the venv whose Python runs it, whether it trains a model that `model init` makes)
EXAMPLES = {
    "tiny-grpo": (".venv", False),
    "fsdp-grpo": (".venv", True),
    "megatron-grpo": (".venv", True),
    "vllm-grpo": (".venv", False),
    "sglang-grpo": (".venv-sglang", False),
}
MODEL_INIT = (
    "--layers 2 --hidden 192 --intermediate 384 --heads 6 --kv-heads 6 --vocab 16 "
    "--max-positions 64 --seed 0"
)
TIMEOUT_S = 900


def run(tree: Path, example: str, steps: int) -> list[dict[str, Any]]:
    """The summary's steps of `example` from `tree`, run for `steps` steps."""
    venv, makes_model = EXAMPLES[example]
    python = str(ROOT / venv / "bin" / "python")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="ts-steptime-") as scratch:
        out = Path(scratch)
        text = (tree / "examples" / f"{example}.toml").read_text()
        # the example's own runtime directory (under /tmp) becomes one of the scratch's
        runtime = f"{tempfile.gettempdir()}/timeshare-{example}"
        text = text.replace(f"runs/{example}", str(out)).replace(runtime, str(out / "rt"))
        job = out / "job.toml"
        job.write_text(text)
        if makes_model:
            init = [python, "-m", "timeshare.daemon.cli", "model", "init", *MODEL_INIT.split()]
            subprocess.run([*init, str(out / "model")], env=env, check=True, cwd=tree)
        command = [python, "-m", "timeshare.daemon.cli", "run", str(job)]
        command += ["--steps", str(steps), "--summary", str(out / "summary.json")]
        subprocess.run(command, env=env, check=True, cwd=tree, timeout=TIMEOUT_S)
        lines = (out / "summary.json").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if "step" in r]  # (the first line names the run)


def figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    timed = steps[1:] or steps

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 4)

    result: dict[str, Any] = {
        "steps": len(steps),
        "step_s": median([s["step_s"] for s in timed]),
        "train_s": median([s["phases"]["train"] for s in timed]),
        "rollout_s": median([s["phases"]["rollout"] for s in timed]),
        "reward_first": steps[0].get("reward_mean"),
        "reward_last": steps[-1].get("reward_mean"),
        "weights_match_every_step": all(s["weights_match"] for s in steps),
    }
    lengths = [s["lengths"] for s in steps if s.get("lengths")]
    if lengths:
        result |= {
            "completion_tokens_mean": median([m["completion_tokens_mean"] for m in lengths]),
            "truncated_fraction": median([m["truncated_fraction"] for m in lengths]),
            "padding_share": median([m["padding_share"] for m in lengths]),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the source tree to run")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--examples", nargs="*", default=list(EXAMPLES), choices=list(EXAMPLES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    print(f"{'example':<15}{'step s':>8}{'train s':>9}{'rollout s':>11}{'padding':>9}{'len':>6}")
    for example in args.examples:
        got = figures(run(args.tree.resolve(), example, args.steps))
        results[example] = got
        padding = got.get("padding_share")
        length = got.get("completion_tokens_mean")
        print(
            f"{example:<15}{got['step_s']:>8.3f}{got['train_s']:>9.3f}{got['rollout_s']:>11.3f}"
            f"{'-' if padding is None else f'{padding:.0%}':>9}"
            f"{'-' if length is None else f'{length:.1f}':>6}",
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"tree": str(args.tree), "results": results}, indent=2))


if __name__ == "__main__":
    main()
