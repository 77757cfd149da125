"""Orchestration overhead: the full cycle with simulated engines that do no work.

    python benchmarks/orchestration.py --ranks 2 8 --steps 60 --rounds 3 \
        --json runs/orchestration.json --before runs/orchestration-before.json

The job comes from --config (default examples/simulated.toml: memory accounting off, so the
engines do no work at all); its runtime dirs are made temporary. For each rank count, one run of
--steps steps with real worker processes, real command lanes, the real weight channel (a few KiB
of weights) and a real store barrier. Reports cycles per second and, per phase, the median and
p99 of each (rank, phase) as the driver saw it: the time from starting both workers' commands
to both results, i.e. what orchestration costs when the engines cost nothing. SYNC carries a real
weight transfer (two round trips of the channel); the row "sync-xfer" is SYNC less the trainer's
own transfer time, the part that is lane calls and worker code.

Each rank count runs --rounds times; a phase's figure is the median of the rounds' medians (one
round on a shared VM can be off by half). The last column of a rank count after the first is its
median over the first's. --before prints an earlier JSON of this benchmark beside this run.
Target: every phase's median under 1 ms at 2 ranks (SYNC counts as sync-xfer), and the same
figure at 8 ranks within 2x.
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
from timeshare.cycle.hooks import RunSummary
from timeshare.cycle.runner import run_cycle
from timeshare.protocols.commands.results import SyncResult
from timeshare.state import Phase

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
TARGET_MEDIAN_MS = 1.0
TARGET_GROWTH = 2.0  # the largest rank count's median over the smallest's


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


def phase_medians(summary: RunSummary) -> dict[str, list[float]]:
    """Each phase's seconds as the driver saw them, sync-xfer among them."""
    seconds = {phase.value: summary.phase_seconds[phase.value] for phase in Phase}
    seconds["sync-xfer"] = [
        r.seconds - r.trainer.transfer.seconds
        for r in summary.reports
        if r.phase is Phase.SYNC and isinstance(r.trainer, SyncResult)
    ]
    return seconds


def row(ranks: int, summaries: list[RunSummary]) -> dict[str, Any]:
    """One rank count over its rounds: per phase the median of the rounds' medians, the worst
    p99, and each round's median."""
    rounds = [phase_medians(summary) for summary in summaries]
    phases = {
        name: {
            "median_ms": statistics.median(statistics.median(r[name]) for r in rounds) * 1000,
            "p99_ms": max(p99(r[name]) for r in rounds) * 1000,
            "round_medians_ms": [statistics.median(r[name]) * 1000 for r in rounds],
            "samples": sum(len(r[name]) for r in rounds),
        }
        for name in rounds[0]
    }
    cycles = [s.step - s.first_step for s in summaries]
    return {
        "ranks": ranks,
        "rounds": len(summaries),
        "cycles": sum(cycles),
        "cycles_per_s": statistics.median(
            c / s.cycle_seconds for c, s in zip(cycles, summaries, strict=True)
        ),
        "phases": phases,
    }


def over_target(ranks: int, smallest: int, median_ms: float, base_ms: float) -> bool:
    if ranks == smallest:
        return median_ms >= TARGET_MEDIAN_MS
    return median_ms > TARGET_GROWTH * max(base_ms, TARGET_MEDIAN_MS)


def print_table(rows: list[dict[str, Any]], title: str = "") -> None:
    """Per phase, a column per rank count (and its growth over the first)."""
    if title:
        print(f"\n{title}")
    first = rows[0]
    header = f"{'phase':<10}" + "".join(
        f"{str(r['ranks']) + ' ranks ms':>14}"
        + ("" if r is first else f"{'x' + str(first['ranks']):>7}")
        for r in rows
    )
    print(header)
    skipped = {"sync"}  # its transfer is the channel's own time: sync-xfer is the overhead
    for phase in first["phases"]:
        line = f"{phase:<10}"
        for r in rows:
            median = r["phases"][phase]["median_ms"]
            base = first["phases"][phase]["median_ms"]
            flag = (
                "*"
                if phase not in skipped and over_target(r["ranks"], first["ranks"], median, base)
                else " "
            )
            line += f"{median:>13.2f}{flag}"
            if r is not first:
                line += f"{median / base:>7.1f}"
        print(line)
    print(
        f"{'cycles/s':<10}"
        + "".join(f"{r['cycles_per_s']:>14.1f}" + ("" if r is first else " " * 7) for r in rows)
    )
    print(
        f"(* over target: < {TARGET_MEDIAN_MS:g} ms at {first['ranks']} ranks, within "
        f"{TARGET_GROWTH:g}x of that at more; sync is the transfer itself, sync-xfer the rest)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=Path("examples/simulated.toml"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--before", type=Path, help="an earlier JSON of this benchmark")
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        summaries = [anyio.run(one_run, args.config, ranks, args.steps) for _ in range(args.rounds)]
        rows.append(row(ranks, summaries))
    if args.before:
        print_table(json.loads(args.before.read_text())["runs"], f"before ({args.before})")
    print_table(rows, "now" if args.before else "")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "target_median_ms": TARGET_MEDIAN_MS,
            "target_growth": TARGET_GROWTH,
            "runs": rows,
        }
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
