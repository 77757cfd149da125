"""Weight-sync benchmark: the weight channel against memory bandwidth and what users would pick.

    python benchmarks/weight_sync.py --total-mb 1024 --bucket-mb 64 --depth 1 2 --json out.json

Every figure is measured on warm buffers and sessions (a warm-up transfer, then the median of
--repeats), in --rounds interleaved rounds, because this machine's memory bandwidth swings from
minute to minute; ratios are taken within a round, then their median is reported. Measured:

  memcpy          one thread copying the same bytes between warm tensors
  two-process     two processes copying at once over a common window, per process: the ceiling
                  of a two-copy pipeline (pack, then copy out) on a machine where both copies
                  share memory bandwidth
  depth N         the weight channel with N staging buffers; the receiver (its own process)
                  copies every tensor into a preallocated model, as an engine's load does
  pickle+zmq      pickled state-dict chunks over ZMQ REQ/REP, unpickled and copied the same way
  gloo            torch.distributed broadcast of every tensor over loopback
  1 MiB latency   one 1 MiB transfer on an open session

Every process runs torch with one intra-op thread, so the figures compare data paths, not
thread counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import zmq

from timeshare.errors import PeerClosed
from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
MIB = 2**20
TENSOR_MB = 16
PEER_TIMEOUT_MS = 120_000  # no wait in the benchmark is unbounded either
TARGETS = {"depth2_vs_two_process": 0.65, "depth2_vs_depth1": 1.15, "latency_1mib_ms": 2.0}


def model(total_mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`total_mb` of fp32 tensors of TENSOR_MB each (the last one smaller), touched."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    left = total_mb * MIB
    while left > 0:
        nbytes = min(TENSOR_MB * MIB, left)
        out[f"layer{len(out)}.weight"] = torch.rand(nbytes // 4, generator=gen)
        left -= nbytes
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median_time(run: Callable[[], float], repeats: int) -> float:
    run()  # warm-up
    return statistics.median(run() for _ in range(repeats))


# -- peers in their own processes ----------------------------------------------------------


def spawn(role: str, **args: Any) -> subprocess.Popen[bytes]:
    argv = [sys.executable, __file__, "--role", role, "--peer-args", json.dumps(args)]
    return subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def weight_receiver(args: dict[str, Any]) -> None:
    destination: dict[str, torch.Tensor] = {}

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            if name not in destination:  # allocated by the warm-up transfer
                destination[name] = torch.empty_like(tensor)
            destination[name].copy_(tensor)

    with WeightReceiver(args["endpoint"], TransferConfig(**args["config"])) as receiver:
        while True:
            try:
                receiver.receive(load)
            except PeerClosed:
                return


def pickle_receiver(args: dict[str, Any]) -> None:
    destination: dict[str, torch.Tensor] = {}
    context = zmq.Context()
    socket = context.socket(zmq.REP)
    socket.setsockopt(zmq.RCVTIMEO, PEER_TIMEOUT_MS)
    socket.connect(args["endpoint"])
    while (message := socket.recv()) != b"stop":
        for name, tensor in pickle.loads(message).items():  # noqa: S301 - the baseline measured
            if name not in destination:  # allocated by the warm-up transfer
                destination[name] = torch.empty_like(tensor)
            destination[name].copy_(tensor)
        socket.send(b"ok")
    socket.send(b"bye")
    socket.close(linger=1000)
    context.term()


def copier(args: dict[str, Any]) -> None:
    """Say ready once warm; read a start time; copy 64 MiB chunks for window_s; print bytes."""
    src = torch.rand(args["total_mb"] * MIB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    chunk = 64 * MIB // 4
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    while time.time() < start:
        time.sleep(0.0005)
    end = start + args["window_s"]
    copied = offset = 0
    while time.time() < end:
        dst[offset : offset + chunk].copy_(src[offset : offset + chunk])
        copied += min(chunk, src.numel() - offset) * 4
        offset = (offset + chunk) % src.numel()
    print(json.dumps({"bytes": copied, "seconds": time.time() - start}), flush=True)


def gloo_peer(args: dict[str, Any]) -> None:
    import torch.distributed as dist

    rank = args["rank"]
    weights = model(args["total_mb"], seed=0 if rank == 0 else 1)
    dist.init_process_group("gloo", init_method=args["init"], rank=rank, world_size=2)
    times = []
    for _ in range(args["repeats"] + 1):
        dist.barrier()
        started = time.perf_counter()
        for tensor in weights.values():
            dist.broadcast(tensor, src=0)
        dist.barrier()
        times.append(time.perf_counter() - started)
    if rank == 0:
        print(json.dumps({"seconds": statistics.median(times[1:])}), flush=True)
    dist.destroy_process_group()


# -- measurements ----------------------------------------------------------------------------


def measure_memcpy(weights: dict[str, torch.Tensor], repeats: int) -> float:
    destination = {name: torch.empty_like(t) for name, t in weights.items()}

    def run() -> float:
        started = time.perf_counter()
        for name, tensor in weights.items():
            destination[name].copy_(tensor)
        return time.perf_counter() - started

    return median_time(run, repeats)


def measure_two_process_copy(total_mb: int, window_s: float = 2.0) -> float:
    """Per-process GB/s of two processes copying over the same window."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "copier",
                "--peer-args",
                json.dumps({"total_mb": total_mb, "window_s": window_s}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    start = time.time() + 0.2
    results = [json.loads(p.communicate(f"{start}\n", timeout=120)[0]) for p in procs]
    return statistics.mean(gbps(r["bytes"], r["seconds"]) for r in results)


async def measure_channel(
    sender: WeightSender, weights: dict[str, torch.Tensor], repeats: int
) -> float:
    await sender.send(weights, version=0)
    seconds = [(await sender.send(weights, version=v)).seconds for v in range(1, repeats + 1)]
    return statistics.median(seconds)


def measure_pickle(
    socket: zmq.Socket[bytes], weights: dict[str, torch.Tensor], bucket_mb: int, repeats: int
) -> float:
    chunks: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in weights.items():
        if sum(t.nbytes for t in chunks[-1].values()) + tensor.nbytes > bucket_mb * MIB:
            chunks.append({})
        chunks[-1][name] = tensor

    def run() -> float:
        started = time.perf_counter()
        for chunk in chunks:
            socket.send(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL))
            socket.recv()
        return time.perf_counter() - started

    return median_time(run, repeats) if repeats else run()


def measure_gloo(total_mb: int, repeats: int, port: int) -> float:
    init = f"tcp://127.0.0.1:{port}"
    peers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "gloo",
                "--peer-args",
                json.dumps({"rank": rank, "init": init, "total_mb": total_mb, "repeats": repeats}),
            ],
            stdout=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    out = [p.communicate(timeout=300)[0] for p in peers]
    seconds: float = json.loads(out[0])["seconds"]
    return seconds


async def benchmark(args: argparse.Namespace, runtime_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    weights = model(args.total_mb)
    nbytes = sum(t.nbytes for t in weights.values())
    small = {"small.weight": torch.rand(MIB // 4)}
    peers: list[subprocess.Popen[bytes]] = []
    senders: dict[int, WeightSender] = {}
    context = zmq.Context()
    pickle_socket = context.socket(zmq.REQ)
    pickle_socket.setsockopt(zmq.RCVTIMEO, PEER_TIMEOUT_MS)
    pickle_socket.setsockopt(zmq.SNDTIMEO, PEER_TIMEOUT_MS)
    try:
        for depth in args.depth:
            config = {"bucket_mb": args.bucket_mb, "pipeline_depth": depth, "ack_timeout_s": 120.0}
            url = f"ipc://{runtime_dir}/w-depth{depth}.sock"
            senders[depth] = WeightSender(url, TransferConfig(**config))
            peers.append(spawn("receiver", endpoint=url, config=config))
        latency_url = f"ipc://{runtime_dir}/w-latency.sock"
        latency_sender = WeightSender(latency_url, TransferConfig(bucket_mb=args.bucket_mb))
        senders[0] = latency_sender
        peers.append(spawn("receiver", endpoint=latency_url, config={"bucket_mb": args.bucket_mb}))
        pickle_url = f"ipc://{runtime_dir}/pickle.sock"
        pickle_socket.bind(pickle_url)
        peers.append(spawn("pickle", endpoint=pickle_url, total_mb=args.total_mb))

        # Every peer up and every session warm before anything is timed.
        for sender in senders.values():
            await sender.send(small, version=0)
        measure_pickle(pickle_socket, small, args.bucket_mb, 0)
        rounds = []
        for index in range(args.rounds):
            row: dict[str, float] = {}
            row["memcpy"] = gbps(nbytes, measure_memcpy(weights, args.repeats))
            row["two_process"] = measure_two_process_copy(args.total_mb)
            for depth in args.depth:
                row[f"depth{depth}"] = gbps(
                    nbytes, await measure_channel(senders[depth], weights, args.repeats)
                )
            row["pickle_zmq"] = gbps(
                nbytes, measure_pickle(pickle_socket, weights, args.bucket_mb, args.repeats)
            )
            row["gloo"] = gbps(nbytes, measure_gloo(args.total_mb, args.repeats, 29500 + index))
            latencies = [
                (await latency_sender.send(small, version=v)).seconds for v in range(1, 51)
            ]
            row["latency_1mib_ms"] = statistics.median(latencies[5:]) * 1000
            rounds.append(row)
            print(
                f"round {index + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                flush=True,
            )
        pickle_socket.send(b"stop")
        pickle_socket.recv()
    finally:
        for sender in senders.values():
            sender.close()
        pickle_socket.close(linger=0)
        context.term()
        for peer in peers:
            try:
                peer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                peer.kill()
    return summarize(args, nbytes, rounds)


def summarize(
    args: argparse.Namespace, nbytes: int, rounds: list[dict[str, float]]
) -> dict[str, Any]:
    def median_of(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def median_ratio(a: str, b: str) -> float:
        return statistics.median(r[a] / r[b] for r in rounds)

    deepest = f"depth{max(args.depth)}"
    ratios = {f"{deepest}_vs_two_process": median_ratio(deepest, "two_process")}
    if len(args.depth) > 1:
        ratios[f"{deepest}_vs_depth{min(args.depth)}"] = median_ratio(
            deepest, f"depth{min(args.depth)}"
        )
    for depth in args.depth:
        ratios[f"depth{depth}_vs_memcpy"] = median_ratio(f"depth{depth}", "memcpy")
    ratios["depth_best_vs_pickle_zmq"] = median_ratio(deepest, "pickle_zmq")
    ratios["depth_best_vs_gloo"] = median_ratio(deepest, "gloo")
    return {
        "total_bytes": nbytes,
        "bucket_mb": args.bucket_mb,
        "tensor_mb": TENSOR_MB,
        "repeats": args.repeats,
        "rounds": rounds,
        "median_gbps": {k: median_of(k) for k in rounds[0] if k != "latency_1mib_ms"},
        "latency_1mib_ms": median_of("latency_1mib_ms"),
        "ratios": ratios,
        "targets": TARGETS,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['total_bytes'] / MIB:.0f} MiB in {result['tensor_mb']} MiB tensors, "
        f"{result['bucket_mb']} MiB buckets, median of {len(result['rounds'])} rounds"
    )
    print(f"{'path':<16}{'GB/s':>8}")
    for key, value in result["median_gbps"].items():
        print(f"{key:<16}{value:>8.2f}")
    latency, target_ms = result["latency_1mib_ms"], TARGETS["latency_1mib_ms"]
    print(f"{'1 MiB latency':<16}{latency:>6.2f} ms  (target < {target_ms} ms)")
    print("\nratio (median of per-round ratios)")
    for key, value in result["ratios"].items():
        target = TARGETS.get(key.replace(f"depth{2}", "depth2"))
        note = f"  (target >= {target})" if target else ""
        print(f"{key:<28}{value:>6.2f}{note}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mb", type=int, default=1024)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--depth", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--peer-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    peer_args = json.loads(args.peer_args)
    roles = {
        "receiver": weight_receiver,
        "pickle": pickle_receiver,
        "copier": copier,
        "gloo": gloo_peer,
    }
    if args.role in roles:
        roles[args.role](peer_args)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir="/tmp") as runtime_dir:
        result = anyio.run(benchmark, args, Path(runtime_dir))
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
