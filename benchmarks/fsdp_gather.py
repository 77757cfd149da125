"""FSDP2 weight sync: all-gather into a fresh tensor and pack it, against all-gather into staging.

    python benchmarks/fsdp_gather.py --total-mb 256 --bucket-mb 64 --rounds 5 --json out.json

Two trainer processes (gloo over loopback, one intra-op thread each) hold the same model, a
`torch.nn.Sequential` of Linear layers of varying sizes (uneven first dimensions among them)
totalling about --total-mb of fp32, `fully_shard`-ed per layer and at the root. Each rank sends
the whole model through its own WeightSender to its own WeightReceiver, a process that copies
every tensor into a preallocated state dict, as an engine's load does. Two ways to send:

  gather-then-pack      items (name, param.full_tensor()): the gather writes a fresh tensor,
                        then the sender copies it into staging (two copies)
  gather-into-staging   ShardGather items (timeshare/engines/fsdp/gather.py): the gather writes
                        straight into staging (one copy)

GB/s = model bytes / seconds of `send` on the slower rank (both start at a barrier). A warm-up
transfer of each way comes first (staging and the receiver's state dict touched); then --rounds
rounds, each timing both ways, in alternating order, since this machine's memory bandwidth
swings from minute to minute; the ratio is taken within a round, then its median reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped
from weight_sync import weight_receiver  # this directory: the receiver every benchmark uses

from timeshare.engines.fsdp.gather import lent_parameters
from timeshare.protocols.weights import TransferConfig, WeightSender
from timeshare.protocols.weights.layout import Weight

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
MIB = 2**20
WORLD = 2
WIDTHS = (1024, 2731, 1536, 4099, 2048, 3001, 1279)  # chained Linear sizes, several uneven
PEER_TIMEOUT = timedelta(seconds=120)  # every collective, store and transfer wait
RUN_TIMEOUT_S = 1800.0  # a whole trainer process, warm-up and rounds
WAYS = ("gather_then_pack", "gather_into_staging")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def channel_config(bucket_mb: int) -> dict[str, Any]:
    seconds = PEER_TIMEOUT.total_seconds()
    return {
        "bucket_mb": bucket_mb,
        "pipeline_depth": 2,
        "ack_timeout_s": seconds,
        "finalize_timeout_s": seconds,
        "handshake_timeout_s": seconds,
        "begin_timeout_s": RUN_TIMEOUT_S,
    }


# -- the model -------------------------------------------------------------------------------


def layer_sizes(total_mb: int) -> list[tuple[int, int]]:
    """(in, out) of chained Linear layers cycling through WIDTHS until about `total_mb` of fp32.

    The widths scale with the square root of the size, so that any size has about a dozen layers
    (one layer's overshoot stays small); an odd width stays odd (uneven shards)."""
    scale = (total_mb / 256) ** 0.5
    widths = [max(1, round(w * scale / 2)) * 2 + w % 2 for w in WIDTHS]
    sizes: list[tuple[int, int]] = []
    left = total_mb * MIB
    while left > 0:
        fan_in, fan_out = widths[len(sizes) % len(widths)], widths[(len(sizes) + 1) % len(widths)]
        sizes.append((fan_in, fan_out))
        left -= (fan_in + 1) * fan_out * 4
    return sizes


def sharded_model(total_mb: int) -> torch.nn.Sequential:
    """The same model on every rank (same seed), sharded per layer and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(i, o) for i, o in layer_sizes(total_mb)))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gathered(model: torch.nn.Module) -> Iterator[tuple[str, Weight]]:
    """(name, full tensor) of every parameter, each gathered into a fresh tensor as asked for."""
    from torch.distributed.tensor import DTensor

    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor)
        with torch.no_grad():  # not around the yield: grad mode is the caller's thread's
            full: torch.Tensor = parameter.full_tensor()
        yield name, full


def lent(model: torch.nn.Module) -> Iterator[tuple[str, Weight]]:
    timeout_s = PEER_TIMEOUT.total_seconds()
    yield from lent_parameters(model, timeout_s=timeout_s)


# -- the processes ---------------------------------------------------------------------------


def spawn(role: str, *, answers: bool, **args: Any) -> subprocess.Popen[str]:
    """A process of this script in `role`; its stdout piped back when it `answers`."""
    argv = [sys.executable, __file__, "--role", role, "--peer-args", json.dumps(args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stdout = subprocess.PIPE if answers else None
    return subprocess.Popen(argv, env=env, stdout=stdout, text=True)


def trainer(args: dict[str, Any]) -> None:
    """One rank: warm both ways up, time them round after round, print the seconds as JSON."""
    store = TCPStore("127.0.0.1", args["port"], is_master=False, timeout=PEER_TIMEOUT)
    rank = args["rank"]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=PEER_TIMEOUT)
    try:
        model = sharded_model(args["total_mb"])
        result = anyio.run(time_rounds, model, args)
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)


async def time_rounds(model: torch.nn.Module, args: dict[str, Any]) -> dict[str, Any]:
    ways: dict[str, Callable[[torch.nn.Module], Iterator[tuple[str, Weight]]]] = {
        "gather_then_pack": gathered,
        "gather_into_staging": lent,
    }
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rounds: list[dict[str, float]] = []
    config = TransferConfig(**channel_config(args["bucket_mb"]))
    with WeightSender(args["endpoint"], config) as sender:
        version = 0
        for way in WAYS:  # warm-up: the handshake, staging and the receiver's state dict
            await sender.send(ways[way](model), version=version)
            version += 1
        for index in range(args["rounds"]):
            row: dict[str, float] = {}
            for way in WAYS if index % 2 == 0 else reversed(WAYS):
                dist.barrier()  # both ranks start together: the gathers wait for the slower
                started = time.perf_counter()
                report = await sender.send(ways[way](model), version=version)
                row[way] = time.perf_counter() - started
                assert report.bytes == nbytes, (report.bytes, nbytes)
                version += 1
            rounds.append(row)
    return {"rank": args["rank"], "bytes": nbytes, "rounds": rounds}


def run_trainers(args: argparse.Namespace, runtime_dir: Path) -> list[dict[str, Any]]:
    """Start a receiver and a trainer per rank; the trainers' results, rank by rank."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=PEER_TIMEOUT)
    config = channel_config(args.bucket_mb)
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(WORLD):
            url = f"ipc://{runtime_dir}/w-rank{rank}.sock"
            procs.append(spawn("receiver", answers=False, endpoint=url, config=config))
            sizes = {"total_mb": args.total_mb, "bucket_mb": args.bucket_mb, "rounds": args.rounds}
            procs.append(
                spawn("trainer", answers=True, rank=rank, port=store.port, endpoint=url, **sizes)
            )
        trainers = procs[1::2]
        outputs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in trainers]
        if any(p.returncode != 0 for p in trainers):
            raise RuntimeError(f"trainer exit codes {[p.returncode for p in trainers]}")
        for peer in procs[0::2]:  # they end when their sender closes the session
            peer.wait(timeout=PEER_TIMEOUT.total_seconds())
        return [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def summarize(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    """GB/s per round and way, from the slower rank's seconds; medians; the ratio."""
    nbytes: int = results[0]["bytes"]
    rounds = [
        {way: gbps(nbytes, max(r["rounds"][i][way] for r in results)) for way in WAYS}
        for i in range(args.rounds)
    ]
    return {
        "total_bytes": nbytes,
        "layers": len(layer_sizes(args.total_mb)),
        "bucket_mb": args.bucket_mb,
        "ranks": WORLD,
        "rounds": rounds,
        "median_gbps": {way: statistics.median(r[way] for r in rounds) for way in WAYS},
        "ratio_into_staging_vs_then_pack": statistics.median(
            r["gather_into_staging"] / r["gather_then_pack"] for r in rounds
        ),
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['total_bytes'] / MIB:.0f} MiB fp32 in {result['layers']} Linear layers, "
        f"{result['bucket_mb']} MiB buckets, {result['ranks']} ranks, "
        f"median of {len(result['rounds'])} rounds"
    )
    print(f"{'path':<22}{'GB/s':>8}")
    for way, value in result["median_gbps"].items():
        print(f"{way.replace('_', '-'):<22}{value:>8.2f}")
    ratio = result["ratio_into_staging_vs_then_pack"]
    print(f"\nratio gather-into-staging / gather-then-pack (median of per-round): {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mb", type=int, default=256)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--peer-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    roles = {"receiver": weight_receiver, "trainer": trainer}
    if args.role in roles:
        roles[args.role](json.loads(args.peer_args))
        return
    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir="/tmp") as runtime_dir:
        results = run_trainers(args, Path(runtime_dir))
    assert [r["rank"] for r in results] == list(range(WORLD))
    summary = summarize(args, results)
    for index, row in enumerate(summary["rounds"]):
        print(f"round {index + 1}: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in row.items()))
    print_table(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
