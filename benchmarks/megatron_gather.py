"""Megatron TP weight sync: all-gather into a fresh tensor and pack it, against all-gather into
staging.

    python benchmarks/megatron_gather.py --total-mb 256 --bucket-mb 64 --rounds 5 --json out.json

Two trainer processes (gloo over loopback, one intra-op thread each) form one tensor-parallel
group of 2 of megatron-core (engines/megatron/parallel.py), each holding its half of a
`GPTModel` (engines/megatron/model.py) loaded from a Llama model directory of about --total-mb
of fp32 that this script writes first (model_dir.init_model_dir, seed 0). Each rank sends the
whole model, as HF-named tensors, through its own WeightSender to its own WeightReceiver, a
process that copies every tensor into a preallocated state dict, as an engine's load does. Two
ways to send, both from `lent_weights` (engines/megatron/gather.py):

  gather-then-pack      items (hf_name, weight.materialize()): the gather writes a fresh tensor,
                        then the sender copies it into staging (two copies)
  gather-into-staging   the TpGather items as lent_weights yields them: a row-split tensor
                        gathers straight into staging (one copy); a column-split one (the
                        row-parallel layers' weights: o_proj, down_proj) gathers rank-major
                        into a buffer, then is transposed into staging (two copies)

Norms are replicated: both ways send them as plain tensors.

GB/s = model bytes / seconds of `send` on the slower rank (both start at a barrier). A warm-up
transfer of each way comes first (staging and the receiver's state dict touched); then --rounds
rounds, each timing both ways, in alternating order, since this machine's memory bandwidth
swings from minute to minute; the ratio is taken within a round, then its median reported.

Before the timed channel opens, each rank sends both ways once to a checker process of its own
(not timed), which keeps what it received and, in the second transfer's finalize, fails unless
every tensor of one way equals the other's and the model directory's safetensors bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped
from weight_sync import weight_receiver  # this directory: the receiver every benchmark uses

from timeshare.engines.megatron.gather import TpGather, lent_weights
from timeshare.engines.megatron.hf_config import HfShape
from timeshare.engines.model_dir import ModelShape, init_model_dir, weight_files
from timeshare.errors import PeerClosed
from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender
from timeshare.protocols.weights.layout import Weight

if TYPE_CHECKING:  # megatron-core itself only in the trainers: its import takes seconds
    from timeshare.engines.megatron.parallel import Layout

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
MIB = 2**20
WORLD = 2  # one tensor-parallel group of WORLD ranks
HEAD_DIM = 64
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


def model_shape(total_mb: int) -> ModelShape:
    """A Llama of about `total_mb` of fp32: about three quarters in its layers, the rest in the
    embedding and the head (the vocabulary fills it up).

    The hidden size scales with the square root of the size (1024 at 256 MiB), so that any size
    has a few layers; heads of HEAD_DIM, two query heads per KV head, an MLP 2.75 times as wide,
    a vocabulary of a multiple of 128: all of it splits over the TP ranks."""
    scale = (total_mb / 256) ** 0.5
    hidden = max(2, round(1024 * scale / (2 * HEAD_DIM))) * 2 * HEAD_DIM
    heads = hidden // HEAD_DIM
    intermediate = round(2.75 * hidden / 64) * 64
    # q and o of hidden x hidden, k and v of half that (two query heads per KV head), the MLP's
    # three, the two norms
    layer_bytes = 4 * (3 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden)
    layers = max(1, int(0.75 * total_mb * MIB / layer_bytes))
    rest = total_mb * MIB - layers * layer_bytes - 4 * hidden  # and the final norm
    vocab = max(1, round(rest / (2 * 4 * hidden) / 128)) * 128
    return ModelShape(
        arch="llama",
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=heads // 2,
        vocab=vocab,
        max_positions=2048,
    )


def tp_model(model_dir: Path, layout: Layout) -> tuple[HfShape, torch.nn.Module]:
    """This TP rank's GPTModel, its halves of the model directory's weights loaded."""
    from timeshare.engines.megatron.model import build_model, load_hf, read_hf

    shape = HfShape.read(model_dir)
    model = build_model(shape, WORLD, torch.device("cpu"))
    load_hf(model, read_hf(model_dir), shape, WORLD, layout.tp_rank)
    return shape, model


def lent(shape: HfShape, model: torch.nn.Module, layout: Layout) -> Iterator[tuple[str, Weight]]:
    """(HF name, weight) of every HF tensor: a TpGather of each split one, as the trainer sends."""
    yield from lent_weights(
        dict(model.named_parameters()),
        shape.params(),
        shape.geometry(WORLD),
        group=layout.tp_group,
        dtype=torch.float32,
        timeout_s=PEER_TIMEOUT.total_seconds(),
    )


def gathered(
    shape: HfShape, model: torch.nn.Module, layout: Layout
) -> Iterator[tuple[str, Weight]]:
    """The same weights, each split one gathered into a fresh tensor as asked for."""
    for name, weight in lent(shape, model, layout):
        yield name, weight.materialize() if isinstance(weight, TpGather) else weight


def column_split_bytes(shape: HfShape) -> int:
    """Bytes of the HF tensors split on columns (gathered rank-major, then transposed)."""
    shapes = shape.hf_shapes()
    return sum(
        4 * math.prod(shapes[name])
        for param in shape.params()
        if param.rule.dim == 1
        for name in param.hf
    )


# -- the processes ---------------------------------------------------------------------------


def spawn(role: str, *, answers: bool, **args: Any) -> subprocess.Popen[str]:
    """A process of this script in `role`; its stdout piped back when it `answers`."""
    argv = [sys.executable, __file__, "--role", role, "--peer-args", json.dumps(args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stdout = subprocess.PIPE if answers else None
    return subprocess.Popen(argv, env=env, stdout=stdout, text=True)


def bit_mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str:
    """What differs between two state dicts, bit for bit ("": nothing)."""
    if got.keys() != want.keys():
        extra, missing = sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys())
        return f"names differ: {extra[:4]} not in the model, {missing[:4]} not received"
    for name, expected in want.items():
        tensor = got[name]
        if (tensor.dtype, tensor.shape) != (expected.dtype, expected.shape):
            have, should = (f"{t.dtype} {tuple(t.shape)}" for t in (tensor, expected))
            return f"{name}: {have}, not {should}"
        as_bytes = (t.contiguous().reshape(-1).view(torch.uint8) for t in (tensor, expected))
        if not torch.equal(*as_bytes):
            return f"{name}: other bits"
    return ""


def checker(args: dict[str, Any]) -> None:
    """Receive one transfer of each way (WAYS' order), keeping copies; in the second one's
    finalize, fail it (the sender sees the error) unless both equal the model directory's
    safetensors bit for bit. Print what was checked as JSON."""
    received: list[dict[str, torch.Tensor]] = []

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            received[-1][name] = tensor.clone()  # a view of staging: valid during the call only

    def check() -> None:
        if len(received) < len(WAYS):
            return
        want: dict[str, torch.Tensor] = {}
        for path in weight_files(Path(args["model_dir"])):
            want.update(load_file(path))
        for way, got in zip(WAYS, received, strict=True):
            problem = bit_mismatch(got, want)
            if problem:
                raise AssertionError(
                    f"rank {args['rank']}, {way} vs the model directory: {problem}"
                )

    with WeightReceiver(args["endpoint"], TransferConfig(**args["config"])) as receiver:
        while True:
            received.append({})
            try:
                receiver.receive(load, check)
            except PeerClosed:
                break
    received.pop()  # the one the session ended in
    nbytes = sum(t.nbytes for t in received[0].values())
    print(json.dumps({"rank": args["rank"], "tensors": len(received[0]), "bytes": nbytes}))


def trainer(args: dict[str, Any]) -> None:
    """One rank: check both ways, warm them up, time them round after round, print the seconds
    as JSON."""
    # megatron-core's notes, not this benchmark's: it falls back to torch for Transformer Engine
    # and Apex (importing), and its config's default CUDA-graph scope is deprecated
    warnings.filterwarnings("ignore", "(Transformer Engine and )?Apex (is|are) not installed")
    warnings.filterwarnings("ignore", "full scope is deprecated")
    from timeshare.engines.megatron import parallel

    store = TCPStore("127.0.0.1", args["port"], is_master=False, timeout=PEER_TIMEOUT)
    rank = args["rank"]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=PEER_TIMEOUT)
    layout = parallel.Layout(rank=rank, world=WORLD, tp=WORLD)
    try:
        # the process group is up: join builds megatron's groups on it
        parallel.join(layout, torch.device("cpu"), None, PEER_TIMEOUT.total_seconds(), seed=0)
        shape, model = tp_model(Path(args["model_dir"]), layout)
        result = anyio.run(time_rounds, shape, model, layout, args)
    finally:
        parallel.leave()
    print(json.dumps(result), flush=True)


async def time_rounds(
    shape: HfShape, model: torch.nn.Module, layout: Layout, args: dict[str, Any]
) -> dict[str, Any]:
    ways: dict[str, Callable[[], Iterator[tuple[str, Weight]]]] = {
        "gather_then_pack": lambda: gathered(shape, model, layout),
        "gather_into_staging": lambda: lent(shape, model, layout),
    }
    nbytes = 4 * sum(math.prod(s) for s in shape.hf_shapes().values())
    config = TransferConfig(**channel_config(args["bucket_mb"]))
    with WeightSender(args["check_endpoint"], config) as sender:  # not timed: the checker's
        for version, way in enumerate(WAYS):
            report = await sender.send(ways[way](), version=version)
            assert report.bytes == nbytes, (report.bytes, nbytes)
    rounds: list[dict[str, float]] = []
    with WeightSender(args["endpoint"], config) as sender:
        version = 0
        for way in WAYS:  # warm-up: the handshake, staging and the receiver's state dict
            await sender.send(ways[way](), version=version)
            version += 1
        for index in range(args["rounds"]):
            row: dict[str, float] = {}
            for way in WAYS if index % 2 == 0 else reversed(WAYS):
                dist.barrier()  # both ranks start together: the gathers wait for the slower
                started = time.perf_counter()
                report = await sender.send(ways[way](), version=version)
                row[way] = time.perf_counter() - started
                assert report.bytes == nbytes, (report.bytes, nbytes)
                version += 1
            rounds.append(row)
    return {"rank": layout.rank, "bytes": nbytes, "rounds": rounds}


def run_trainers(
    args: argparse.Namespace, runtime_dir: Path, model_dir: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Start a receiver, a checker and a trainer per rank; the trainers' results and the
    checkers' reports, rank by rank."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=PEER_TIMEOUT)
    config = channel_config(args.bucket_mb)
    receivers: list[subprocess.Popen[str]] = []
    checkers: list[subprocess.Popen[str]] = []
    trainers: list[subprocess.Popen[str]] = []
    try:
        for rank in range(WORLD):
            url = f"ipc://{runtime_dir}/w-rank{rank}.sock"
            check_url = f"ipc://{runtime_dir}/check-rank{rank}.sock"
            receivers.append(spawn("receiver", answers=False, endpoint=url, config=config))
            checkers.append(
                spawn(
                    "checker",
                    answers=True,
                    rank=rank,
                    endpoint=check_url,
                    config=config,
                    model_dir=str(model_dir),
                )
            )
            sizes = {"bucket_mb": args.bucket_mb, "rounds": args.rounds}
            trainers.append(
                spawn(
                    "trainer",
                    answers=True,
                    rank=rank,
                    port=store.port,
                    endpoint=url,
                    check_endpoint=check_url,
                    model_dir=str(model_dir),
                    **sizes,
                )
            )
        outputs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in trainers]
        checked = [p.communicate(timeout=PEER_TIMEOUT.total_seconds())[0] for p in checkers]
        if any(p.returncode != 0 for p in trainers + checkers):
            raise RuntimeError(
                f"trainer exit codes {[p.returncode for p in trainers]}, "
                f"checker exit codes {[p.returncode for p in checkers]}"
            )
        for peer in receivers:  # they end when their sender closes the session
            peer.wait(timeout=PEER_TIMEOUT.total_seconds())
        results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
        return results, [json.loads(out.strip().splitlines()[-1]) for out in checked]
    finally:
        for proc in receivers + checkers + trainers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def summarize(
    args: argparse.Namespace, shape: HfShape, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """GB/s per round and way, from the slower rank's seconds; medians; the ratio."""
    nbytes: int = results[0]["bytes"]
    rounds = [
        {way: gbps(nbytes, max(r["rounds"][i][way] for r in results)) for way in WAYS}
        for i in range(args.rounds)
    ]
    return {
        "total_bytes": nbytes,
        "column_split_bytes": column_split_bytes(shape),
        "hf_tensors": len(shape.hf_shapes()),
        "layers": shape.layers,
        "hidden": shape.hidden,
        "vocab": shape.vocab,
        "bucket_mb": args.bucket_mb,
        "tp": WORLD,
        "checked": "both ways == the model directory, bit for bit, on every rank",
        "rounds": rounds,
        "median_gbps": {way: statistics.median(r[way] for r in rounds) for way in WAYS},
        "ratio_into_staging_vs_then_pack": statistics.median(
            r["gather_into_staging"] / r["gather_then_pack"] for r in rounds
        ),
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['total_bytes'] / MIB:.0f} MiB fp32 in {result['hf_tensors']} HF tensors "
        f"(Llama: {result['layers']} layers, hidden {result['hidden']}, vocab {result['vocab']}; "
        f"{result['column_split_bytes'] / result['total_bytes']:.0%} of the bytes column-split), "
        f"TP {result['tp']}, {result['bucket_mb']} MiB buckets, "
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
    roles = {"receiver": weight_receiver, "checker": checker, "trainer": trainer}
    if args.role in roles:
        roles[args.role](json.loads(args.peer_args))
        return
    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir="/tmp") as runtime_dir:
        model_dir = init_model_dir(Path(runtime_dir) / "model", model_shape(args.total_mb), seed=0)
        shape = HfShape.read(model_dir)
        results, checked = run_trainers(args, Path(runtime_dir), model_dir)
    assert [r["rank"] for r in results] == list(range(WORLD))
    assert [c["rank"] for c in checked] == list(range(WORLD))
    for report in checked:
        assert report["bytes"] == results[0]["bytes"], (report, results[0]["bytes"])
        print(f"rank {report['rank']}: {report['tensors']} tensors checked, bit for bit")
    summary = summarize(args, shape, results)
    for index, row in enumerate(summary["rounds"]):
        print(f"round {index + 1}: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in row.items()))
    print_table(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
