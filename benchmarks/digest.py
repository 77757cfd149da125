"""Hash candidates for the per-step weights check, against memcpy on the same bytes.

    python benchmarks/digest.py --mb 256 --rounds 5 --json runs/digest.json

The digest (`timeshare/engines/digest.py`) must cost a small part of a SYNC, which moves each
byte once or twice at memory speed; so a candidate is measured in GB/s beside one memcpy of the
same buffer, interleaved over --rounds (this machine's bandwidth swings), best of each round,
median over rounds. A candidate whose package is not installed is listed as such.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import xxhash


def candidates() -> dict[str, Callable[[memoryview], object] | None]:
    found: dict[str, Callable[[memoryview], object] | None] = {
        "xxh3-128 (chosen)": lambda data: xxhash.xxh3_128(data).digest(),
        "xxh3-64": lambda data: xxhash.xxh3_64(data).digest(),
        "xxh64": lambda data: xxhash.xxh64(data).digest(),
        "sha256 (before)": lambda data: hashlib.sha256(data).digest(),
        "blake2b": lambda data: hashlib.blake2b(data).digest(),
        "zlib.crc32": zlib.crc32,
    }
    try:
        import crc32c  # type: ignore[import-not-found]

        found["crc32c (hw)"] = crc32c.crc32c
    except ImportError:
        found["crc32c (hw)"] = None
    return found


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="bytes hashed per call, MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="calls per round (best counts)")
    parser.add_argument("--json", type=Path, help="write the table here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = torch.randint(0, 256, (args.mb << 20,), dtype=torch.uint8)
    dest = torch.empty_like(source)
    data: memoryview = source.numpy().data
    hashes = candidates()
    rates: dict[str, list[float]] = {name: [] for name in ["memcpy", *hashes]}
    for _ in range(args.rounds):
        copy = best_seconds(lambda: dest.copy_(source), args.repeats)
        rates["memcpy"].append(source.nbytes / copy)
        for name, run in hashes.items():
            if run is not None:
                seconds = best_seconds(partial(run, data), args.repeats)
                rates[name].append(source.nbytes / seconds)
    memcpy = statistics.median(rates["memcpy"])
    rows = []
    print(f"{'candidate':20s} {'GB/s':>7s} {'x memcpy':>9s}")
    for name, measured in rates.items():
        if not measured:
            print(f"{name:20s} {'not installed':>17s}")
            continue
        rate = statistics.median(measured)
        rows.append({"candidate": name, "gb_per_s": rate / 1e9, "of_memcpy": rate / memcpy})
        print(f"{name:20s} {rate / 1e9:7.2f} {rate / memcpy:9.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        table = {"mb": args.mb, "rounds": args.rounds, "rows": rows}
        args.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
