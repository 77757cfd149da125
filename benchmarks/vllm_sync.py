"""Weight sync into a running vLLM engine: timeshare's backend against the bare channel and
against what a user would otherwise do.

    python benchmarks/vllm_sync.py --json runs/vllm_sync.json        (make bench-vllm)

The model is the reference Llama at --hidden/--intermediate/--layers (default 4 layers of
1024/4096: 268 MB of fp32 weights), sent in --bucket-mb buckets. Each figure is the wall time
of one whole SYNC as the trainer sees it, from the first call to the weights being usable:

  bare channel    WeightSender -> a WeightReceiver in its own process that copies every tensor
                  into a preallocated model (benchmarks/weight_sync.py's receiver)
  into vLLM       WeightSender -> the timeshare backend in vLLM's worker, driven through LLM's
                  methods (start, update, report, finish): vLLM's layerwise reload and post-load
                  processing included, and the digest of what arrived (weights_match)
  no digest       the same without the digest (what weights_match costs)
  reload /dev/shm what a user would do without a backend: safetensors written to /dev/shm,
                  then vLLM's reload_weights from there
  ..._tp2         the same into a second engine of tensor_parallel_size 2 (--tensor-parallel
                  1 2, the default): one sender, each bucket packed once into staging both TP
                  workers map, each worker loading its shard; vLLM's reload at TP 2 beside it

Rounds are interleaved (this machine's memory bandwidth swings); ratios are taken within a
round and their median reported. Target: into vLLM >= 0.7 x the bare channel.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
import torch
from safetensors.torch import save_file
from weight_sync import spawn

from timeshare.engines.model_config import ModelConfig
from timeshare.engines.model_dir import write_config_dir
from timeshare.engines.torch_ref.model import init_model
from timeshare.engines.vllm.engine import VllmInlet, VllmRollout
from timeshare.engines.vllm.report import worker_reports
from timeshare.engines.vllm.spec import VllmSpec
from timeshare.protocols.weights import TransferConfig, WeightSender

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
TARGET = 0.7
Named = list[tuple[str, torch.Tensor]]


def timed(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` runs (after the warm-up the caller did)."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


class IntoVllm:
    """A trainer's sender (its own thread) and the engine's inlet."""

    def __init__(self, rollout: VllmRollout, endpoint: str, config: TransferConfig) -> None:
        self.rollout = rollout
        self.trainer = ThreadPoolExecutor(1)
        workers = rollout.spec.tensor_parallel_size
        make = partial(WeightSender, endpoint, config, receivers=workers)
        self.sender = self.trainer.submit(make).result()
        self.inlet = VllmInlet(rollout, endpoint, config)
        self.version = 0

    def sync(self, weights: Named, *, digest: bool) -> None:
        self.version += 1
        sent = self.trainer.submit(
            anyio.run, partial(self.sender.send, weights, version=self.version)
        )
        self.rollout.begin_weight_update()
        self.inlet.receive(lambda: None, digest=digest)
        sent.result(timeout=600)

    def close(self) -> None:
        self.trainer.submit(self.sender.close).result(timeout=60)
        self.trainer.shutdown()
        self.inlet.close()


def reload_from_shm(rollout: VllmRollout, weights: Named, directory: Path) -> None:
    """Write safetensors to /dev/shm and have vLLM reload them (a user's way without a backend)."""
    save_file(
        {name: tensor.contiguous() for name, tensor in weights}, directory / "model.safetensors"
    )
    rollout.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory)})


def benchmark(args: argparse.Namespace, runtime_dir: Path, shm_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = ModelConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=64,
    )
    weights = [(n, p.detach()) for n, p in init_model(config, seed=0).named_parameters()]
    nbytes = sum(t.nbytes for _, t in weights)
    transfer = TransferConfig(
        bucket_mb=args.bucket_mb,
        ack_timeout_s=300.0,
        begin_timeout_s=300.0,
        finalize_timeout_s=300.0,
        handshake_timeout_s=300.0,
    )
    channel = {"bucket_mb": args.bucket_mb, "ack_timeout_s": 300.0}
    bare_url = f"ipc://{runtime_dir}/w-bare.sock"
    bare = WeightSender(bare_url, TransferConfig(**channel))
    peer = spawn("receiver", endpoint=bare_url, config=channel)
    # vLLM reloads only from a model it loaded from files (not from dummy weights): it starts
    # from a transformers directory of the model.
    model_dir = write_config_dir(config, runtime_dir / "model")
    save_file(dict(weights), model_dir / "model.safetensors")
    spec = VllmSpec(
        model_dir=str(model_dir), max_model_len=32, kv_cache_mb=16.0, generate_timeout_s=600.0
    )
    engines: dict[int, IntoVllm] = {}
    try:
        for tp in args.tensor_parallel:
            tp_spec = msgspec.structs.replace(spec, tensor_parallel_size=tp)
            rollout = VllmRollout(0, tp_spec, config, call_timeout_s=600.0, runtime_dir=runtime_dir)
            engines[tp] = IntoVllm(rollout, f"ipc://{runtime_dir}/w-vllm-tp{tp}.sock", transfer)
        bare_version = iter(range(1, 1_000_000))

        def bare_sync() -> None:
            anyio.run(partial(bare.send, weights, version=next(bare_version)))

        methods: dict[str, Callable[[], object]] = {"bare_channel": bare_sync}
        for tp, into in engines.items():
            suffix = "" if tp == 1 else f"_tp{tp}"
            methods |= {
                f"into_vllm{suffix}": partial(into.sync, weights, digest=True),
                f"into_vllm_no_digest{suffix}": partial(into.sync, weights, digest=False),
                f"reload_shm{suffix}": partial(reload_from_shm, into.rollout, weights, shm_dir),
            }
        for run in methods.values():  # every path warm before anything is timed
            run()
        rounds = []
        for index in range(args.rounds):
            row = {name: nbytes / timed(run, args.repeats) / 1e9 for name, run in methods.items()}
            rounds.append(row)
            print(f"round {index + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        loaded: dict[str, list[int]] = {}
        for tp, into in engines.items():
            into.sync(weights, digest=True)
            answers = into.rollout.llm.collective_rpc("timeshare_report")
            for inside in worker_reports(answers, 0, tp):
                spent = inside.spent
                print(
                    f"inside vLLM's TP {tp} worker {inside.worker}, one version (s): "
                    f"digest_s {spent.digest_s:.3f}, copy_s {spent.copy_s:.3f}, "
                    f"load_s {spent.load_s:.3f}, finalize_s {spent.finalize_s:.3f}, "
                    f"call_s {inside.call_s:.3f}, bytes loaded {inside.transfer.bytes}"
                )
                loaded.setdefault(f"tp{tp}", []).append(inside.transfer.bytes)
    finally:
        for into in engines.values():
            into.close()
            into.rollout.close()
        bare.close()
        try:
            peer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            peer.kill()
    return summarize(rounds, nbytes, args, loaded)


def summarize(
    rounds: list[dict[str, float]],
    nbytes: int,
    args: argparse.Namespace,
    loaded: dict[str, list[int]],
) -> dict[str, Any]:
    def ratio(a: str, b: str) -> float | None:
        if a not in rounds[0] or b not in rounds[0]:
            return None
        return statistics.median(row[a] / row[b] for row in rounds)

    medians = {key: statistics.median(row[key] for row in rounds) for key in rounds[0]}
    return {
        "model_bytes": nbytes,
        "bucket_mb": args.bucket_mb,
        "rounds": rounds,
        "gbps": medians,
        "seconds": {key: nbytes / value / 1e9 for key, value in medians.items()},
        "bytes_loaded_per_worker": loaded,
        "into_vllm_vs_bare": ratio("into_vllm", "bare_channel"),
        "into_vllm_no_digest_vs_bare": ratio("into_vllm_no_digest", "bare_channel"),
        "into_vllm_vs_reload_shm": ratio("into_vllm", "reload_shm"),
        "into_vllm_tp2_vs_into_vllm": ratio("into_vllm_tp2", "into_vllm"),
        "into_vllm_tp2_vs_reload_shm_tp2": ratio("into_vllm_tp2", "reload_shm_tp2"),
        "target_into_vllm_vs_bare": TARGET,
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['model_bytes'] / 1e6:.0f} MB of weights, {result['bucket_mb']} MiB buckets")
    print(f"{'path':<28}{'GB/s (median)':>16}{'SYNC s':>10}")
    for name, value in result["gbps"].items():
        print(f"{name:<28}{value:>16.3f}{result['seconds'][name]:>10.3f}")
    for engine, loaded in result["bytes_loaded_per_worker"].items():
        print(f"bytes loaded per worker, {engine}: {loaded}")
    print(
        f"\ninto vLLM / bare channel: {result['into_vllm_vs_bare']:.2f} "
        f"(target >= {TARGET}); without the digest: {result['into_vllm_no_digest_vs_bare']:.2f}; "
        f"into vLLM / reload from /dev/shm: {result['into_vllm_vs_reload_shm']:.2f}"
    )
    if result["into_vllm_tp2_vs_into_vllm"] is not None:
        print(
            f"into vLLM at TP 2 / at TP 1: {result['into_vllm_tp2_vs_into_vllm']:.2f}; "
            f"into vLLM at TP 2 / reload at TP 2: {result['into_vllm_tp2_vs_reload_shm_tp2']:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tensor-parallel", type=int, nargs="+", default=[1, 2], help="an engine of each size"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    runtime_dir = Path(tempfile.mkdtemp(prefix="ts-bench-", dir="/tmp"))
    shm_dir = Path(tempfile.mkdtemp(prefix="ts-bench-reload-", dir="/dev/shm"))
    try:
        result = benchmark(args, runtime_dir, shm_dir)
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
