"""Reward pool throughput and the prompt dataset's data path: speed and memory.

    python benchmarks/reward.py
    python benchmarks/reward.py --rows 100000 --repeats 2 --json runs/bench/reward-quick.json

Part 1, the reward pool (timeshare/task/reward_pool.py): for a reward function that sleeps
`--fast-ms` (1 ms) and one that sleeps `--slow-ms` (200 ms), each at every `--processes`
count (1, 2, 4), a pool is started (its start time is reported on its own), warmed with one
call per process, then scores a batch of B samples `--repeats` times (B: `--fast-batch` 256,
`--slow-batch` 32). The batch's wall time is what a ROLLOUT of B samples waits on rewards;
samples/s is B over it. "ideal s" is B x sleep / processes, the wait with no overhead at all.

Part 2, the data path (timeshare/task/dataset.py): a parquet file of `--rows` rows (a chat
prompt of one ~40-character user message, a string label; row groups of 65536 rows) is
written to a temporary directory, then a fresh process (this file with --data-only, so that
its peak RSS is the data path's alone) times `PromptRows.open`, `iter_rows()` over the whole
file, and `--steps` steps of `--step-rows` random rows (`positions` then `rows`), recording
its peak RSS after the imports and after each phase (VmHWM; ru_maxrss is shown too, but in a
child it includes its parent's peak: see peak_rss_mib). Another fresh process does the naive
`pq.read_table(file).to_pylist()`, for comparison.

The figures are noisy on a shared machine: each is the min and median over the repeats.
Everything is printed as two tables and written as JSON (`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROW_GROUP_ROWS = 65536
TIMEOUT_S = 1800

REWARDS = '''"""Reward functions of benchmarks/reward.py: each sleeps, then compares."""

import time


def sleep_fast(completion, label):
    time.sleep({fast_s!r})
    return 1.0 if completion.endswith(str(label)) else 0.0


def sleep_slow(completion, label):
    time.sleep({slow_s!r})
    return 1.0 if completion.endswith(str(label)) else 0.0
'''


def peak_rss_mib() -> float:
    """This process's peak resident set so far, in MiB: VmHWM, the peak of its own address
    space, where Linux has it; else ru_maxrss (KiB). Linux's ru_maxrss of a process includes
    the peak of the process that forked it (exec keeps the old address space's peak), so in
    a fresh child it reads at least the parent's peak: `ru_maxrss_mib` is recorded too."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return ru_maxrss_mib()


def ru_maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summary(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 5), "median": round(statistics.median(values), 5)}


# -- part 1: the reward pool -----------------------------------------------------------------------


def bench_pool(
    rewards: Path, name: str, *, sleep_s: float, processes: int, batch: int, repeats: int
) -> dict[str, Any]:
    from timeshare.task.reward_function import RewardCall, RewardSpec
    from timeshare.task.reward_pool import RewardPool

    spec = RewardSpec(path=str(rewards), name=name, timeout_s=60.0, processes=processes)
    calls = [
        RewardCall(
            sample_id=f"s{i}",
            row_index=i,
            completion=f"Let me think step by step about it. {'x' * 120} The answer is {i % 7}",
            prompt=f"What is {i} modulo 7? Answer with a number.",
            label=i % 7,
        )
        for i in range(batch)
    ]
    started = time.perf_counter()
    pool = RewardPool(spec, base_dir=rewards.parent)
    try:
        start_s = time.perf_counter() - started
        pool.score(calls[:processes])  # each process's first call (warm-up)
        walls = []
        for _ in range(repeats):
            began = time.perf_counter()
            outcomes = pool.score(calls)
            walls.append(time.perf_counter() - began)
            failed = [o.error for o in outcomes if o.error is not None or o.score is None]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} calls failed, e.g. {failed[0]}")
    finally:
        pool.close()
    return {
        "sleep_ms": sleep_s * 1000,
        "processes": processes,
        "batch": batch,
        "start_s": round(start_s, 4),
        "batch_s": summary(walls),
        "samples_per_s": summary([batch / wall for wall in walls])
        | {"max": round(batch / min(walls), 5)},
        "ideal_batch_s": round(batch * sleep_s / processes, 5),
        "walls_s": [round(wall, 5) for wall in walls],
    }


def reward_part(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    rewards = scratch / "rewards.py"
    fast_s, slow_s = args.fast_ms / 1000, args.slow_ms / 1000
    rewards.write_text(REWARDS.format(fast_s=fast_s, slow_s=slow_s))
    results = []
    header = (
        f"{'reward':>8}{'procs':>7}{'batch':>7}{'start s':>9}{'batch s min':>13}"
        f"{'batch s med':>13}{'ideal s':>9}{'samples/s med':>15}{'samples/s max':>15}"
    )
    print(f"reward pool ({args.repeats} repeats per row)")
    print(header)
    print("-" * len(header))
    for name, sleep_s, batch in (
        ("sleep_fast", fast_s, args.fast_batch),
        ("sleep_slow", slow_s, args.slow_batch),
    ):
        for processes in args.processes:
            got = bench_pool(
                rewards,
                name,
                sleep_s=sleep_s,
                processes=processes,
                batch=batch,
                repeats=args.repeats,
            )
            results.append(got)
            print(
                f"{f'{sleep_s * 1000:g} ms':>8}{processes:>7}{batch:>7}{got['start_s']:>9.3f}"
                f"{got['batch_s']['min']:>13.4f}{got['batch_s']['median']:>13.4f}"
                f"{got['ideal_batch_s']:>9.3f}{got['samples_per_s']['median']:>15.1f}"
                f"{got['samples_per_s']['max']:>15.1f}",
                flush=True,
            )
    print()
    return results


# -- part 2: the data path -------------------------------------------------------------------------


def write_parquet(path: Path, rows: int) -> float:
    """A parquet file of `rows` chat prompts and string labels; the seconds it took."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    began = time.perf_counter()
    schema = pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("label", pa.string()),
        ]
    )
    with pq.ParquetWriter(str(path), schema) as writer:
        for first in range(0, rows, ROW_GROUP_ROWS):
            numbers = range(first, min(rows, first + ROW_GROUP_ROWS))
            contents = pa.array([f"What is {i} plus {i % 997}? Answer briefly." for i in numbers])
            roles = pa.array(["user"] * len(numbers))
            messages = pa.StructArray.from_arrays([roles, contents], names=["role", "content"])
            offsets = pa.array(range(len(numbers) + 1), type=pa.int32())
            prompts = pa.ListArray.from_arrays(offsets, messages, type=schema.field(0).type)
            labels = pa.array([str(i + i % 997) for i in numbers])
            table = pa.Table.from_arrays([prompts, labels], schema=schema)
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
    return time.perf_counter() - began


def data_only(path: Path, steps: int, step_rows: int) -> dict[str, Any]:
    """The data path, timed in this (fresh) process; its peak RSS after each phase."""
    import pyarrow.parquet  # noqa: F401 - imported before the baseline, as the data path does

    from timeshare.task.dataset import PromptRows, positions

    got: dict[str, Any] = {"rss_import_mib": round(peak_rss_mib(), 1)}
    began = time.perf_counter()
    data = PromptRows.open([path], prompt_key="prompt", label_key="label")
    try:
        got["open_s"] = round(time.perf_counter() - began, 5)
        got["rows"] = len(data)
        got["rss_open_mib"] = round(peak_rss_mib(), 1)

        began = time.perf_counter()
        count = sum(1 for _ in data.iter_rows())
        iter_s = time.perf_counter() - began
        assert count == len(data), (count, len(data))
        got["iter_s"] = round(iter_s, 4)
        got["iter_rows_per_s"] = round(count / iter_s, 1)
        got["rss_iter_mib"] = round(peak_rss_mib(), 1)

        positions_s, rows_s = [], []
        for step in range(steps):
            began = time.perf_counter()
            indices = positions(0, step, 0, 1, step_rows, len(data))
            middle = time.perf_counter()
            rows = data.rows(indices)
            ended = time.perf_counter()
            assert len(rows) == step_rows and isinstance(rows[0].prompt, list)
            positions_s.append(middle - began)
            rows_s.append(ended - middle)
        steps_s = [p + r for p, r in zip(positions_s, rows_s, strict=True)]
        total = sum(steps_s)
        got["random"] = {
            "steps": steps,
            "step_rows": step_rows,
            "total_s": round(total, 4),
            "rows_per_s": round(steps * step_rows / total, 1),
            "step_s": summary(steps_s) | {"max": round(max(steps_s), 5)},
            "positions_s": summary(positions_s),
            "rows_s": summary(rows_s),
        }
        got["rss_random_mib"] = round(peak_rss_mib(), 1)
        got["ru_maxrss_mib"] = round(ru_maxrss_mib(), 1)
    finally:
        data.close()
    return got


def naive_only(path: Path) -> dict[str, Any]:
    """`pq.read_table(path).to_pylist()` in this (fresh) process: its time and peak RSS."""
    import pyarrow.parquet as pq

    got: dict[str, Any] = {"rss_import_mib": round(peak_rss_mib(), 1)}
    began = time.perf_counter()
    values = pq.read_table(str(path)).to_pylist()
    got["s"] = round(time.perf_counter() - began, 4)
    got["rows"] = len(values)
    got["rss_peak_mib"] = round(peak_rss_mib(), 1)
    got["ru_maxrss_mib"] = round(ru_maxrss_mib(), 1)
    return got


def in_fresh_process(*arguments: str) -> dict[str, Any]:
    """This file run with `arguments` in a new interpreter; the JSON its last line prints."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *arguments],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def data_part(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    path = scratch / "prompts.parquet"
    write_s = write_parquet(path, args.rows)
    size_mib = path.stat().st_size / 2**20
    groups = -(-args.rows // ROW_GROUP_ROWS)
    steps = ["--steps", str(args.steps), "--step-rows", str(args.step_rows)]
    ours = in_fresh_process("--data-only", str(path), *steps)
    naive = in_fresh_process("--naive-only", str(path))
    random = ours["random"]
    print(
        f"data path ({args.rows:,} rows, {groups} row groups, {size_mib:.1f} MiB parquet, "
        f"written in {write_s:.2f} s; peak RSS of a fresh process)"
    )
    header = f"{'phase':<38}{'s':>10}{'rows/s':>12}{'peak RSS MiB':>14}"
    print(header)
    print("-" * len(header))
    table = [
        ("imports (pyarrow, dataset)", None, None, ours["rss_import_mib"]),
        ("PromptRows.open", ours["open_s"], None, ours["rss_open_mib"]),
        ("iter_rows() whole file", ours["iter_s"], ours["iter_rows_per_s"], ours["rss_iter_mib"]),
        (
            f"positions+rows, {random['step_rows']}/step x {random['steps']}",
            random["total_s"],
            random["rows_per_s"],
            ours["rss_random_mib"],
        ),
        ("  one step, median", random["step_s"]["median"], None, None),
        ("  one step, min", random["step_s"]["min"], None, None),
        ("  one step, max", random["step_s"]["max"], None, None),
        ("  positions() alone, median", random["positions_s"]["median"], None, None),
        ("  (its ru_maxrss, parent's included)", None, None, ours["ru_maxrss_mib"]),
        ("naive: imports (pyarrow)", None, None, naive["rss_import_mib"]),
        (
            "naive: read_table().to_pylist()",
            naive["s"],
            naive["rows"] / naive["s"],
            naive["rss_peak_mib"],
        ),
        ("  (its ru_maxrss, parent's included)", None, None, naive["ru_maxrss_mib"]),
    ]
    for what, seconds, rate, rss in table:
        print(
            f"{what:<38}{'-' if seconds is None else f'{seconds:.5f}':>10}"
            f"{'-' if rate is None else f'{rate:,.0f}':>12}"
            f"{'-' if rss is None else f'{rss:.1f}':>14}"
        )
    print()
    return {
        "rows": args.rows,
        "row_group_rows": ROW_GROUP_ROWS,
        "file_mib": round(size_mib, 2),
        "write_s": round(write_s, 3),
        "dataset": ours,
        "naive_to_pylist": naive,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="scored batches per pool")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--fast-ms", type=float, default=1.0)
    parser.add_argument("--slow-ms", type=float, default=200.0)
    parser.add_argument("--fast-batch", type=int, default=256)
    parser.add_argument("--slow-batch", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the parquet file")
    parser.add_argument("--steps", type=int, default=50, help="random-access steps")
    parser.add_argument("--step-rows", type=int, default=128, help="rows a step reads")
    parser.add_argument("--skip-rewards", action="store_true")
    parser.add_argument("--skip-data", action="store_true")
    parser.add_argument("--json", type=Path, default=ROOT / "runs" / "bench" / "reward.json")
    # (internal: the fresh processes of part 2)
    parser.add_argument("--data-only", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--naive-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.data_only is not None:
        print(json.dumps(data_only(args.data_only, args.steps, args.step_rows)))
        return
    if args.naive_only is not None:
        print(json.dumps(naive_only(args.naive_only)))
        return

    results: dict[str, Any] = {"cpus": os.cpu_count(), "repeats": args.repeats}
    scratch = Path(tempfile.mkdtemp(prefix="ts-bench-reward-"))
    try:
        if not args.skip_rewards:
            results["reward_pool"] = reward_part(args, scratch)
        if not args.skip_data:
            results["data_path"] = data_part(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
