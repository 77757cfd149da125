"""What a second node costs per phase: one job of 4 ranks run as 1 node x 4 and as 2 nodes x 2.

    python benchmarks/nodes.py --steps 30 --json runs/nodes.json

The job is examples/cluster/job.toml (the main GRPO job, torch_ref). Both layouts run on this
machine, one after the other, each from a fresh checkpoint directory: 1 x 4 under one
`timeshare run`, 2 x 2 under two (the leader's job store on loopback). Each phase's time is the
slowest rank's (for 2 x 2, the slower node's); the table shows the medians over steps 2..N, and
what 2 x 2 adds: the crossings of the nodes at every fence, the job-wide BARRIER, the beats.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from timeshare.report.summary import read_summary

JOB = Path(__file__).resolve().parent.parent / "examples" / "cluster" / "job.toml"
PHASES = ("train", "offload", "sync", "barrier", "resume", "rollout")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run_layout(root: Path, nodes: int, steps: int) -> tuple[list[list[dict[str, Any]]], float]:
    """Every node's steps (from its summary), and the wall time of the whole run."""
    port = free_port()
    processes = []
    started = time.monotonic()
    for node in range(nodes):
        env = {
            **os.environ,
            "TIMESHARE_JOB__STEPS": str(steps),
            "TIMESHARE_JOB__RUNTIME_DIR": str(root / f"run{node}"),
            "TIMESHARE_JOB__CHECKPOINT_DIR": str(root / "checkpoints"),
            "TIMESHARE_CLUSTER__NODES": str(nodes),
            "TIMESHARE_CLUSTER__NODE_RANK": str(node),
            "TIMESHARE_CLUSTER__RANKS_PER_NODE": str(4 // nodes),
            "TIMESHARE_CLUSTER__LEADER_PORT": str(port),
        }
        summary = root / f"node{node}.json"
        command = [sys.executable, "-m", "timeshare", "run", str(JOB), "--summary", str(summary)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL))
    try:
        codes = [process.wait(timeout=1800) for process in processes]
    finally:  # one timed out, or an interrupt: no node's run is left behind
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    seconds = time.monotonic() - started
    if any(codes):
        raise SystemExit(f"{nodes} node(s): timeshare run exited {codes}")
    return [read_summary(root / f"node{n}.json").steps for n in range(nodes)], seconds


def medians(by_node: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Per phase: the median over steps 2..N of the slowest node's time."""
    steps = list(zip(*by_node, strict=True))[1:]
    table = {
        p: statistics.median(max(n["phases"][p] for n in step) for step in steps) for p in PHASES
    }
    table["step"] = statistics.median(max(n["step_s"] for n in step) for step in steps)
    table["bubble"] = statistics.median(max(n["bubble_s"] for n in step) for step in steps)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {"steps": args.steps, "layouts": {}}
    for nodes in (1, 2):
        with tempfile.TemporaryDirectory(prefix="ts-nodes-") as directory:
            by_node, seconds = run_layout(Path(directory), nodes, args.steps)
        name = f"{nodes}x{4 // nodes}"
        results["layouts"][name] = {"median_s": medians(by_node), "run_s": seconds}
        agree = (
            [a["weights_digest"] == b["weights_digest"] for a, b in zip(*by_node, strict=True)]
            if nodes > 1
            else [True]
        )
        results["layouts"][name]["nodes_agree"] = all(agree)
    one, two = results["layouts"]["1x4"]["median_s"], results["layouts"]["2x2"]["median_s"]
    print(f"{'phase':<9} {'1x4 ms':>9} {'2x2 ms':>9} {'added ms':>9}")
    for phase in (*PHASES, "bubble", "step"):
        print(
            f"{phase:<9} {one[phase] * 1e3:>9.1f} {two[phase] * 1e3:>9.1f} "
            f"{(two[phase] - one[phase]) * 1e3:>9.1f}"
        )
    agree = results["layouts"]["2x2"]["nodes_agree"]
    print(f"2x2: every step the same weights on both nodes: {agree}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
