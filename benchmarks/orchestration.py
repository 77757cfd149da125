"""Orchestration overhead: the full cycle with simulated engines that do no work.

    python benchmarks/orchestration.py --ranks 2 4 --steps 30 --json runs/orchestration.json

The job comes from --config (default examples/simulated.toml: memory accounting off, so the
engines do no work at all); its runtime dirs are made temporary. For each rank count, one run of
--steps steps with real worker processes, real command lanes, the real weight channel (a few KiB
of weights) and a real store barrier. Reports cycles per second and, per phase, the median and
p99 of each (rank, phase) as the driver saw it: the time from starting both workers' commands
to both results, i.e. what orchestration costs when the engines cost nothing. SYNC carries a real
weight transfer (two round trips of the channel); the row "sync-xfer" is SYNC less the trainer's
own transfer time, the part that is lane calls and worker code.
Target: under 2 ms per phase median on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from timeshare.config import load_config
from timeshare.cycle import RunSummary, run_cycle
from timeshare.protocols.commands.results import SyncResult
from timeshare.state import Phase

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
TARGET_MEDIAN_MS = 2.0


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def one_run(config_path: Path, ranks: int, steps: int) -> RunSummary:
    with tempfile.TemporaryDirectory(prefix="ts-orch-", dir="/tmp") as directory:
        loaded = load_config(config_path, environ={})
        job = msgspec.structs.replace(
            loaded.config.job,
            runtime_dir=f"{directory}/run",
            checkpoint_dir=f"{directory}/checkpoints",
            ranks=ranks,
            steps=steps,
        )
        return await run_cycle(msgspec.structs.replace(loaded.config, job=job))


def row(ranks: int, summary: RunSummary) -> dict[str, Any]:
    cycles = summary.step - summary.first_step
    seconds = {phase.value: summary.phase_seconds[phase.value] for phase in Phase}
    seconds["sync-xfer"] = [
        r.seconds - r.trainer.transfer.seconds
        for r in summary.reports
        if r.phase is Phase.SYNC and isinstance(r.trainer, SyncResult)
    ]
    phases = {
        name: {
            "median_ms": statistics.median(values) * 1000,
            "p99_ms": p99(values) * 1000,
            "samples": len(values),
        }
        for name, values in seconds.items()
    }
    return {
        "ranks": ranks,
        "cycles": cycles,
        "cycles_per_s": cycles / summary.cycle_seconds,
        "phases": phases,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    for result in rows:
        print(
            f"\n{result['ranks']} ranks: {result['cycles']} cycles, "
            f"{result['cycles_per_s']:.1f} cycles/s"
        )
        print(f"{'phase':<10}{'median ms':>11}{'p99 ms':>9}")
        for phase, figures in result["phases"].items():
            flag = "" if figures["median_ms"] < TARGET_MEDIAN_MS else "  (over target)"
            print(f"{phase:<10}{figures['median_ms']:>11.2f}{figures['p99_ms']:>9.2f}{flag}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=Path("examples/simulated.toml"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [row(r, anyio.run(one_run, args.config, r, args.steps)) for r in args.ranks]
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"target_median_ms": TARGET_MEDIAN_MS, "runs": rows}, indent=2)
        )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
