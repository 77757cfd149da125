"""The cold first SYNC: a fresh sender and receiver, staging made from nothing, one version.

    python benchmarks/cold_sync.py --total-mb 1024 --bucket-mb 64 512 --json runs/cold_sync.json

This is what a job's first step and every restart pay. Each round starts a receiver process
with its model already allocated and touched (an engine's weights exist before the first sync),
then times, on the trainer's side, one whole version from the first call to the receiver's last
answer:

  timeshare     WeightSender.send on a new session: staging created and faulted in, the
                handshake, every bucket through the pipeline (depth 2), FINALIZED
  verl-style    verl's design (bucketed_weight_transfer.py), written here: ONE shared-memory
                buffer of a bucket, created at the start of the sync; per bucket a pickled
                header over ZMQ REQ/REP and an empty ACK; the receiver maps the buffer at the
                first bucket and copies every tensor out

Both receivers copy each tensor into the preallocated model. Rounds alternate the two.
Target (issue 26): timeshare's cold time <= verl-style's at 64 MiB and 512 MiB buckets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import zmq
from weight_sync import model

from timeshare.errors import PeerClosed
from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender
from timeshare.runtime import SHM_ROOT

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
MIB = 2**20
TIMEOUT_MS = 120_000  # no wait here is unbounded either


def spawn(role: str, **args: Any) -> subprocess.Popen[str]:
    argv = [sys.executable, __file__, "--role", role, "--peer-args", json.dumps(args)]
    peer = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert peer.stdout is not None
    if peer.stdout.readline().strip() != "ready":  # its model is allocated and touched
        peer.kill()
        raise RuntimeError(f"{role} receiver did not start")
    return peer


@contextlib.contextmanager
def running(role: str, **args: Any) -> Iterator[None]:
    """A receiver process for the block: waited for after it, killed if the block failed."""
    peer = spawn(role, **args)
    try:
        yield
    except BaseException:
        peer.kill()
        raise
    finally:
        peer.wait(timeout=120)


def destination(total_mb: int) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in model(total_mb).items()}


def timeshare_receiver(args: dict[str, Any]) -> None:
    weights = destination(args["total_mb"])

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            weights[name].copy_(tensor)

    with WeightReceiver(args["endpoint"], TransferConfig(**args["config"])) as receiver:
        print("ready", flush=True)
        try:
            receiver.receive(load)
        except PeerClosed:
            return


def verl_receiver(args: dict[str, Any]) -> None:
    weights = destination(args["total_mb"])
    context = zmq.Context()
    socket = context.socket(zmq.REP)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    socket.connect(args["endpoint"])
    print("ready", flush=True)
    buffer: torch.Tensor | None = None
    while True:
        header = pickle.loads(socket.recv())  # noqa: S301 - the design measured
        if header is None:
            socket.send(b"")
            break
        if buffer is None:  # mapped once, at the first bucket
            fd = os.open(header["segment"], os.O_RDWR)
            mapped = mmap.mmap(fd, header["bucket_bytes"], flags=mmap.MAP_SHARED)
            os.close(fd)
            buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        for name, offset, nbytes in header["tensors"]:
            weights[name].view(torch.uint8).view(-1).copy_(buffer[offset : offset + nbytes])
        socket.send(b"")
    socket.close(linger=0)
    context.term()


def timeshare_cold(
    weights: dict[str, torch.Tensor], total_mb: int, bucket_mb: int, runtime_dir: Path
) -> float:
    config: dict[str, Any] = {
        "bucket_mb": bucket_mb,
        "pipeline_depth": 2,
        "ack_timeout_s": 120.0,
        "handshake_timeout_s": 120.0,
        "begin_timeout_s": 120.0,
        "finalize_timeout_s": 120.0,
    }
    endpoint = f"ipc://{runtime_dir}/cold.sock"
    receiver = running("timeshare", endpoint=endpoint, config=config, total_mb=total_mb)
    with WeightSender(endpoint, TransferConfig(**config)) as sender, receiver:
        started = time.perf_counter()
        anyio.run(lambda: sender.send(weights, version=1))
        return time.perf_counter() - started


def verl_cold(
    weights: dict[str, torch.Tensor], total_mb: int, bucket_mb: int, runtime_dir: Path
) -> float:
    endpoint = f"ipc://{runtime_dir}/verl.sock"
    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    socket.bind(endpoint)
    try:
        with running("verl", endpoint=endpoint, total_mb=total_mb):
            return verl_send(socket, weights, bucket_mb * MIB)
    finally:
        socket.close(linger=0)
        context.term()


def verl_send(
    socket: zmq.Socket[bytes], weights: dict[str, torch.Tensor], bucket_bytes: int
) -> float:
    """One version through one shared buffer made now, as verl sends it; the seconds it took."""
    if any(tensor.nbytes > bucket_bytes for tensor in weights.values()):
        raise ValueError("verl-style sends whole tensors: each must fit in a bucket")
    segment = str(SHM_ROOT / f"ts-bench-verl-{os.getpid()}")
    started = time.perf_counter()
    fd = os.open(segment, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, bucket_bytes)
        mapped = mmap.mmap(fd, bucket_bytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.unlink(segment)
        raise
    finally:
        os.close(fd)
    buffer = torch.frombuffer(mapped, dtype=torch.uint8)
    try:
        items = list(weights.items())
        while items:
            tensors, offset = [], 0
            while items and offset + items[0][1].nbytes <= bucket_bytes:
                name, tensor = items.pop(0)
                buffer[offset : offset + tensor.nbytes].copy_(tensor.view(torch.uint8).view(-1))
                tensors.append((name, offset, tensor.nbytes))
                offset += tensor.nbytes
            header = {"segment": segment, "bucket_bytes": bucket_bytes, "tensors": tensors}
            socket.send(pickle.dumps(header))
            socket.recv()  # the receiver copied the bucket out: the buffer is free again
        socket.send(pickle.dumps(None))
        socket.recv()
        return time.perf_counter() - started
    finally:
        os.unlink(segment)  # (the receiver opens it by name at the first bucket)
        del buffer
        mapped.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mb", type=int, default=1024)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--peer-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    roles = {"timeshare": timeshare_receiver, "verl": verl_receiver}
    if args.role in roles:
        roles[args.role](json.loads(args.peer_args))
        return
    weights = model(args.total_mb)
    methods = {"timeshare": timeshare_cold, "verl_style": verl_cold}
    seconds: dict[int, dict[str, list[float]]] = {
        b: {m: [] for m in methods} for b in args.bucket_mb
    }
    with tempfile.TemporaryDirectory(prefix="ts-cold-", dir="/tmp") as directory:
        for index in range(args.rounds):
            for bucket_mb in args.bucket_mb:
                for name, run in methods.items():
                    seconds[bucket_mb][name].append(
                        run(weights, args.total_mb, bucket_mb, Path(directory))
                    )
            print(
                f"round {index + 1}: "
                + ", ".join(
                    f"{b} MiB {m} {seconds[b][m][-1]:.3f} s"
                    for b in args.bucket_mb
                    for m in methods
                )
            )
    rows = []
    print(f"\ncold first sync of {args.total_mb} MiB, median of {args.rounds} rounds")
    print(f"{'bucket MiB':>10} {'timeshare s':>12} {'verl-style s':>13} {'ratio':>7}")
    for bucket_mb in args.bucket_mb:
        ours = statistics.median(seconds[bucket_mb]["timeshare"])
        theirs = statistics.median(seconds[bucket_mb]["verl_style"])
        rows.append(
            {
                "bucket_mb": bucket_mb,
                "timeshare_s": ours,
                "verl_style_s": theirs,
                "rounds": seconds[bucket_mb],
            }
        )
        print(f"{bucket_mb:>10} {ours:>12.3f} {theirs:>13.3f} {ours / theirs:>7.2f}")
    print("target: timeshare <= verl-style (ratio <= 1.00)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"total_mb": args.total_mb, "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
