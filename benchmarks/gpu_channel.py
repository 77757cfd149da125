"""The weight channel on a GPU against the device's own copy: GB/s device to device.

    python benchmarks/gpu_channel.py --total-mb 1024 --bucket-mb 64 --json runs/gpu_channel.json

One sender (this process) and one receiver process on the same device; the weights are made on
the device from a seed on both sides, so the receiver checks every version bit for bit. With
weights on CUDA, transport "auto" stages them on the sender's GPU (CUDA IPC): the figure is
staging in, a handle's worth of headers, staging out into the receiver's tensors. The peak is
`copy_` of the whole model between two buffers of the device (cudaMemcpy device to device):
the channel copies twice (into staging, out of it), so half the peak is its ceiling. The first
transfer (handshake and staging made) is reported apart. --device cpu runs the same over shared
memory (a check of the benchmark itself on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
TENSOR_MB = 64


def model(total_mb: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    count = max(1, total_mb // TENSOR_MB)
    numel = min(total_mb, TENSOR_MB) * 2**20 // 4
    return {f"w{i}": torch.randn(numel, generator=gen).to(device) for i in range(count)}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_copy_gbps(total_mb: int, device: str, rounds: int) -> float:
    nbytes = total_mb * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def receiver(args: dict[str, Any]) -> None:
    device = args["device"]
    expected = model(args["total_mb"], device)
    into = {name: torch.empty_like(t) for name, t in expected.items()}

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            into[name].copy_(tensor)

    config = TransferConfig(bucket_mb=args["bucket_mb"])
    with WeightReceiver(args["endpoint"], config, device=device) as channel:
        print(json.dumps({"ready": True}), flush=True)
        for _ in range(args["transfers"]):
            channel.receive(load)
    synchronize(device)
    same = all(torch.equal(into[name], expected[name]) for name in expected)
    print(json.dumps({"bit_identical": same}), flush=True)


async def send_all(endpoint: str, args: argparse.Namespace, transfers: int) -> list[float]:
    """Send the model `transfers` times; each transfer's seconds."""
    weights = model(args.total_mb, args.device)
    seconds = []
    with WeightSender(endpoint, TransferConfig(bucket_mb=args.bucket_mb)) as channel:
        for version in range(transfers):
            started = time.perf_counter()
            await channel.send(weights, version=version)
            seconds.append(time.perf_counter() - started)
    return seconds


def sender(args: argparse.Namespace, runtime: Path) -> dict[str, Any]:
    endpoint = f"ipc://{runtime}/w.sock"
    transfers = args.rounds + 1
    peer_args = {
        "device": args.device,
        "total_mb": args.total_mb,
        "bucket_mb": args.bucket_mb,
        "endpoint": endpoint,
        "transfers": transfers,
    }
    argv = [sys.executable, __file__, "--role", "receiver", "--peer-args", json.dumps(peer_args)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        if not process.stdout.readline():
            raise SystemExit(f"the receiver exited ({process.wait()}) before it was ready")
        seconds = anyio.run(send_all, endpoint, args, transfers)
        verdict = json.loads(process.stdout.readline() or "{}")
        if "bit_identical" not in verdict:
            raise SystemExit(f"the receiver exited ({process.wait()}) without its verdict")
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    nbytes = max(1, args.total_mb // TENSOR_MB) * min(args.total_mb, TENSOR_MB) * 2**20  # model's
    warm = statistics.median(seconds[1:])
    return {
        "bytes": nbytes,
        "cold_s": seconds[0],
        "warm_s": warm,
        "channel_gbps": nbytes / warm / 1e9,
        "bit_identical": verdict["bit_identical"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--total-mb", type=int, default=1024)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--peer-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "receiver":
        receiver(json.loads(args.peer_args))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {args.device}: this torch sees no CUDA device (--device cpu: a dry run)"
        )
    with tempfile.TemporaryDirectory(prefix="ts-gpu-channel-", dir="/tmp") as runtime:
        result = sender(args, Path(runtime))
    result["peak_copy_gbps"] = peak_copy_gbps(args.total_mb, args.device, args.rounds)
    result["of_peak"] = result["channel_gbps"] / result["peak_copy_gbps"]
    result |= {"device": args.device, "total_mb": args.total_mb, "bucket_mb": args.bucket_mb}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    print(f"{'device':<22}{args.device}  ({result.get('gpu', 'no GPU')})")
    print(f"{'model':<22}{result['bytes'] / 2**20:.0f} MiB, {args.bucket_mb} MiB buckets")
    print(f"{'device copy peak':<22}{result['peak_copy_gbps']:.1f} GB/s")
    print(
        f"{'channel, warm':<22}{result['channel_gbps']:.1f} GB/s ({result['of_peak']:.2f} of peak)"
    )
    print(f"{'first transfer':<22}{result['cold_s']:.3f} s")
    print(f"{'bit identical':<22}{result['bit_identical']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    if not result["bit_identical"]:
        raise SystemExit("the receiver's weights differ from the sender's")


if __name__ == "__main__":
    main()
