"""Weight sync into a running SGLang engine: timeshare's channel against what a user would
otherwise do.

    .venv-sglang/bin/python benchmarks/sglang_sync.py --json runs/sglang_sync.json

SGLang 0.5.23's CPU engine serves a reference Llama of about --total-mb MiB of float32 weights
(layers of --hidden/--intermediate; default 4 layers of 1024/4096: 258 MiB, HF names). Each
figure is the wall time of one whole sync as the trainer sees it, from its first call to the
engine holding the new weights:

  timeshare        WeightSender -> timeshare's loader in SGLang's scheduler (SglangRollout's
                   inlet), in --bucket-mb staging buckets, --depth deep: once without the digest
                   (the channel's speed), once with it (what a job does each step: weights_match)
  disk             what a user would do without a channel: the weights written as safetensors to
                   /dev/shm (the trainer writes them each step: timed), SGLang's
                   update_weights_from_disk from there, the file removed
  tensor (verl)    SGLang's update_weights_from_tensor as verl's SGLang rollout drives it:
                   buckets of cloned tensors, each tensor through SGLang's MultiprocessingSerializer
                   (shared memory on CPU), inside 0.5.23's weight-update session, then
                   flush_cache (on the CPU engine a gc.collect in SGLang's scheduler, which
                   verl would not pay on GPUs: the speed-up without it is printed too)

Every sync loads one of two weight sets (seeds 0 and 1), never the one the engine holds, and is
checked afterwards (not timed): a greedy generate must give what that set gave after a
timeshare sync whose digest matched the set's. Rounds are interleaved (this machine's memory
bandwidth swings); the speed-up is the faster alternative's median time over timeshare's.
This process runs torch on one thread: each trainer-side copy is one thread in every path.
--sweep adds timeshare rows with other buckets (MiBxDEPTH, e.g. 16x2) to the same rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
import torch
from safetensors.torch import save_file

from timeshare.engines.base import RolloutRequest, SamplingParams
from timeshare.engines.digest import weights_digest
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.sglang.engine import SglangInlet, SglangRollout
from timeshare.engines.sglang.spec import SglangSpec
from timeshare.engines.torch_ref.model import init_model
from timeshare.protocols.weights import TransferConfig, TransferReport, WeightSender
from timeshare.units import MIB

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
TARGET = 1.5  # timeshare's speed-up over the faster alternative
# verl's default rollout.checkpoint_engine.update_weights_bucket_megabytes
# (verl/workers/config/rollout.py): a model of this size is one bucket.
VERL_BUCKET_MB = 2048
PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, seed=0)
LOGPROB_TOLERANCE = 1e-4
Named = list[tuple[str, torch.Tensor]]
Phases = dict[str, float]
Output = tuple[tuple[int, ...], tuple[float, ...]]  # a greedy completion's tokens and logprobs
LABELS = {
    "timeshare": "timeshare, digest off (*)",
    "timeshare_digest": "timeshare, digest on",
    "disk": "disk (/dev/shm safetensors)",
    "tensor_verl": "tensor (verl)",
}
ALTERNATIVES = ("disk", "tensor_verl")


class Laps:
    """Seconds by phase: each `lap(name)` adds the time since the last lap to `name`."""

    def __init__(self) -> None:
        self.phases: Phases = {}
        self.mark = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.mark
        self.mark = now


def model_config(args: argparse.Namespace) -> ModelConfig:
    """A Llama of at least --total-mb MiB: whole layers of --hidden/--intermediate."""
    hidden, intermediate = args.hidden, args.intermediate
    layer_bytes = 4 * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden)
    return ModelConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=max(1, math.ceil(args.total_mb * MIB / layer_bytes)),
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=64,
    )


def checked(what: str, answer: Any) -> None:
    """SGLang's (success, message[, ...]) answer, or an output object carrying them."""
    if isinstance(answer, tuple):
        success, message = bool(answer[0]), str(answer[1])
    else:
        success, message = bool(getattr(answer, "success", True)), str(answer)
    assert success, f"SGLang refused {what}: {message}"


def spans_of(report: TransferReport, side: str) -> Phases:
    """The report's spans summed by kind ("pack 3" and "pack 4" are both "pack")."""
    phases: Phases = {}
    for span in report.spans:
        key = f"{side} {span.name.split()[0]}"
        phases[key] = phases.get(key, 0.0) + span.seconds
    return phases


class Timeshare:
    """A trainer's sender (its own thread, as a trainer's would be) and the engine's inlet."""

    def __init__(self, rollout: SglangRollout, endpoint: str, transfer: TransferConfig) -> None:
        self.rollout = rollout
        self.trainer = ThreadPoolExecutor(1)
        self.sender = self.trainer.submit(WeightSender, endpoint, transfer).result()
        self.inlet: SglangInlet = rollout.open_inlet(endpoint, transfer)
        self.version = 0

    def sync(self, weights: Named, *, digest: bool) -> Phases:
        started = time.perf_counter()
        self.version += 1
        sent = self.trainer.submit(
            anyio.run, partial(self.sender.send, weights, version=self.version)
        )
        self.rollout.begin_weight_update()
        received = self.inlet.receive(lambda: None, digest=digest)
        report = sent.result(timeout=600)
        assert self.rollout.weight_version == self.version, self.rollout.weight_version
        # "channel": inside SGLang's scheduler, the receiver's first bucket to FINALIZED;
        # "around": the rest (SGLang's session calls and the order, the answer read back)
        around = time.perf_counter() - started - received.seconds
        phases = {"channel": received.seconds, "around": around}
        return phases | spans_of(report, "sender") | spans_of(received, "receiver")

    def close(self) -> None:
        self.trainer.submit(self.sender.close).result(timeout=60)
        self.trainer.shutdown()
        self.inlet.close()


def via_disk(engine: Any, weights: Named, directory: Path) -> Phases:
    """safetensors into /dev/shm, SGLang's update_weights_from_disk from there, file removed.

    0.5.23 needs no weight-update session for it: the scheduler's update_weights_from_disk
    checks none, and the model runner's restores the weights, loads and post-processes them
    itself (sglang/srt/managers/scheduler_components/weight_updater.py and
    model_executor/model_runner_components/weight_updater.py). The load format is named: the
    engine started from dummy weights, and SGLang would otherwise take its own (dummy)."""
    path = directory / "model.safetensors"
    laps = Laps()
    try:
        save_file({name: tensor.contiguous() for name, tensor in weights}, path)
        laps.lap("write")
        checked(
            "update_weights_from_disk",
            engine.update_weights_from_disk(model_path=str(directory), load_format="safetensors"),
        )
        laps.lap("load")
    finally:
        path.unlink(missing_ok=True)
    laps.lap("remove")
    return laps.phases


def named_tensor_buckets(weights: Named, bucket_bytes: int) -> Iterator[Named]:
    """verl's get_named_tensor_buckets (verl/workers/rollout/sglang_rollout/utils.py): buckets
    of at most `bucket_bytes`, every tensor cloned. (verl's is an async generator; SGLang's
    Engine runs its own event loop, so this one is plain.)"""
    bucket: Named = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.element_size() * tensor.numel()
        if size + nbytes > bucket_bytes and bucket:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.clone()))
        size += nbytes
    if bucket:
        yield bucket


def via_tensor_verl(engine: Any, weights: Named, bucket_mb: int) -> Phases:
    """update_weights_from_tensor as verl drives it, reproduced for one TP rank.

    Followed: volcengine/verl@b178a3c, verl/workers/rollout/sglang_rollout/sglang_rollout.py,
    `ServerAdapter.update_weights`: for each bucket of `get_named_tensor_buckets(weights,
    update_weights_bucket_megabytes << 20)` it awaits SGLang's own
    `sglang.srt.weight_sync.utils.update_weights(engine, params_batch, "infer_tp", mesh)`, which
    serializes each tensor with `MultiprocessingSerializer`, gathers the TP ranks' handles into
    one `LocalSerializedTensor` per name and sends `UpdateWeightsFromTensorReqInput(
    serialized_named_tensors=[serialize(named_tensors)] * tp, load_format=None)` (SGLang's
    default flush_cache=True); after the last bucket, `flush_cache()`. verl reaches SGLang's
    server over HTTP (base64 of the same bytes); here `Engine.update_weights_from_tensor` makes
    the same request in process (one hop fewer: in the alternative's favour). SGLang 0.5.23
    refuses update_weights_from_tensor outside a weight-update session: begin/end around it
    (sglang/srt/weight_sync/utils.py says its caller must hold one).
    """
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        LocalSerializedTensor,
    )
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    laps = Laps()
    checked("begin_weight_update", engine.begin_weight_update())
    laps.lap("begin")
    try:
        buckets = named_tensor_buckets(weights, bucket_mb * MIB)
        while (bucket := next(buckets, None)) is not None:
            laps.lap("clone")
            if bucket[0][1].is_cuda:
                # SGLang's update_weights calls it first: CUDA handles carry the device's UUID.
                # It breaks the pickling of CPU tensors (an IndexError): on CUDA only.
                monkey_patch_torch_reductions()
            # on CPU, serializing a tensor moves its storage into shared memory (a copy)
            named = [
                (name, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(t)]))
                for name, t in bucket
            ]
            laps.lap("serialize")
            checked(
                "update_weights_from_tensor",
                engine.update_weights_from_tensor(named_tensors=named, load_format=None),
            )
            del named, bucket  # the bucket's shared memory goes once SGLang has loaded it
            laps.lap("update")
    finally:
        checked("end_weight_update", engine.end_weight_update())
        laps.lap("end")
        checked("flush_cache", engine.flush_cache())
        laps.lap("flush")
    return laps.phases


def greedy(rollout: SglangRollout) -> Output:
    (sample,) = rollout.generate([RolloutRequest("check", PROMPT, GREEDY)])
    return sample.tokens, sample.logprobs


def check_holds(rollout: SglangRollout, expected: Output, what: str) -> None:
    """The engine's greedy completion is the one of the weights `what` was to load."""
    tokens, logprobs = greedy(rollout)
    assert tokens == expected[0], f"{what}: greedy tokens {tokens}, expected {expected[0]}"
    worst = max(abs(a - b) for a, b in zip(logprobs, expected[1], strict=True))
    assert worst < LOGPROB_TOLERANCE, f"{what}: logprobs differ by {worst:g}"


def sweep_config(text: str) -> tuple[float, int]:
    """`MiBxDEPTH`, e.g. 16x2."""
    mb, depth = text.lower().split("x")
    return float(mb), int(depth)


def transfer_config(bucket_mb: float, depth: int) -> TransferConfig:
    return TransferConfig(
        bucket_mb=bucket_mb,
        pipeline_depth=depth,
        ack_timeout_s=300.0,
        begin_timeout_s=300.0,
        finalize_timeout_s=300.0,
        handshake_timeout_s=300.0,
    )


def benchmark(args: argparse.Namespace, runtime_dir: Path, shm_dir: Path) -> dict[str, Any]:
    config = model_config(args)
    sets = [
        [(n, p.detach()) for n, p in init_model(config, seed=s).named_parameters()] for s in (0, 1)
    ]
    digests = [weights_digest(weights) for weights in sets]
    nbytes = sum(t.nbytes for _, t in sets[0])
    print(
        f"{nbytes / MIB:.1f} MiB of float32 weights ({nbytes} bytes, {len(sets[0])} tensors): "
        f"{config.num_hidden_layers} layers of {config.hidden_size}/"
        f"{config.intermediate_size}; starting SGLang's CPU engine",
        flush=True,
    )
    spec = SglangSpec(context_length=64, max_total_tokens=1024, generate_timeout_s=120.0)
    rollout = SglangRollout(0, spec, config, call_timeout_s=600.0, runtime_dir=runtime_dir)
    torch.set_num_threads(1)  # the trainer's side: one copy thread in every path
    channels: list[Timeshare] = []
    try:

        def channel(bucket_mb: float, depth: int) -> Timeshare:
            endpoint = f"ipc://{runtime_dir}/w-{bucket_mb:g}x{depth}.sock"
            channels.append(Timeshare(rollout, endpoint, transfer_config(bucket_mb, depth)))
            return channels[-1]

        main = channel(args.bucket_mb, args.depth)
        # What each set gives, from a timeshare sync whose digest matches the set's
        expected: list[Output] = []
        for index, weights in enumerate(sets):
            main.sync(weights, digest=True)
            assert rollout.digest() == digests[index], "timeshare: digest differs from the set's"
            expected.append(greedy(rollout))
        assert expected[0][0] != expected[1][0], "both weight sets give the same completion"

        methods: dict[str, Callable[[Named], Phases]] = {
            "timeshare": lambda w: main.sync(w, digest=False),
            "timeshare_digest": lambda w: main.sync(w, digest=True),
            "disk": lambda w: via_disk(rollout.sgl, w, shm_dir),
            "tensor_verl": lambda w: via_tensor_verl(rollout.sgl, w, args.verl_bucket_mb),
        }
        for bucket_mb, depth in args.sweep:
            name = f"timeshare_{bucket_mb:g}x{depth}"
            LABELS[name] = f"timeshare {bucket_mb:g} MiB x{depth}, digest off"
            methods[name] = partial(channel(bucket_mb, depth).sync, digest=False)

        turn = 0

        def run(name: str) -> tuple[float, Phases]:
            """One sync of the set the engine does not hold, timed, then checked."""
            nonlocal turn
            index, turn = turn % 2, turn + 1
            started = time.perf_counter()
            phases = methods[name](sets[index])
            seconds = time.perf_counter() - started
            check_holds(rollout, expected[index], name)
            if name == "timeshare_digest":
                assert rollout.digest() == digests[index], "timeshare: digest differs"
            return seconds, phases

        for name in methods:  # every path warm before anything is timed
            run(name)
        rounds: list[dict[str, float]] = []
        phases: dict[str, list[Phases]] = {name: [] for name in methods}
        for index in range(args.rounds):
            row = {}
            for name in methods:
                row[name], spent = run(name)
                phases[name].append(spent)
            rounds.append(row)
            print(
                f"round {index + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()),
                flush=True,
            )
    finally:
        for opened in channels:
            opened.close()
        rollout.close()
    return summarize(rounds, phases, nbytes, config, args)


def summarize(
    rounds: list[dict[str, float]],
    phases: dict[str, list[Phases]],
    nbytes: int,
    config: ModelConfig,
    args: argparse.Namespace,
) -> dict[str, Any]:
    seconds = {
        name: {
            "min": min(row[name] for row in rounds),
            "median": statistics.median(row[name] for row in rounds),
            "max": max(row[name] for row in rounds),
        }
        for name in rounds[0]
    }
    faster = min(ALTERNATIVES, key=lambda name: seconds[name]["median"])

    def speedup(name: str, alternative: float | None = None) -> float:
        return (alternative or seconds[faster]["median"]) / seconds[name]["median"]

    # verl's last flush_cache is SGLang's gc.collect on CPU (platforms/cpu.py's empty_cache),
    # a cost verl does not pay on GPUs: the speed-up without it too, for comparison.
    verl = zip(rounds, phases["tensor_verl"], strict=True)
    unflushed = statistics.median(row["tensor_verl"] - spent["flush"] for row, spent in verl)
    without = min(seconds["disk"]["median"], unflushed)

    return {
        "model_bytes": nbytes,
        "model_mib": nbytes / MIB,
        "model": msgspec.structs.asdict(config),
        "sglang": version("sglang"),
        "bucket_mb": args.bucket_mb,
        "pipeline_depth": args.depth,
        "verl_bucket_mb": args.verl_bucket_mb,
        "rounds": rounds,
        "seconds": seconds,
        "gbps": {name: nbytes / s["median"] / 1e9 for name, s in seconds.items()},
        "phases_median_s": {
            name: {key: statistics.median(p[key] for p in runs) for key in runs[0]}
            for name, runs in phases.items()
        },
        "labels": {name: LABELS[name] for name in seconds},
        "faster_alternative": faster,
        "speedup_digest_off": speedup("timeshare"),
        "speedup_digest_on": speedup("timeshare_digest"),
        "target_speedup": TARGET,
        "tensor_verl_without_final_flush_s": unflushed,
        "speedup_without_verl_final_flush": {
            "digest_off": speedup("timeshare", without),
            "digest_on": speedup("timeshare_digest", without),
        },
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['model_mib']:.1f} MiB of float32 weights into SGLang {result['sglang']} "
        f"(CPU engine), {len(result['rounds'])} rounds; timeshare: {result['bucket_mb']:g} MiB "
        f"buckets, depth {result['pipeline_depth']}; verl: {result['verl_bucket_mb']} MiB "
        "buckets"
    )
    print(f"{'method':<36}{'min s':>9}{'median s':>10}{'max s':>9}{'GB/s (median)':>15}")
    for name, s in result["seconds"].items():
        print(
            f"{result['labels'][name]:<36}{s['min']:>9.3f}{s['median']:>10.3f}{s['max']:>9.3f}"
            f"{result['gbps'][name]:>15.3f}"
        )
    print(
        "(*) digest off: the channel's speed; a job hashes what arrives every step "
        "(weights_match): digest on"
    )
    print(
        f"\nspeed-up of timeshare over the faster alternative, "
        f"{result['labels'][result['faster_alternative']]}, by median time: "
        f"{result['speedup_digest_off']:.2f}x digest off, {result['speedup_digest_on']:.2f}x "
        f"digest on (target >= {TARGET})"
    )
    flushless = result["speedup_without_verl_final_flush"]
    print(
        f"tensor (verl) without its last flush_cache (SGLang's CPU engine runs gc.collect in "
        f"it): {result['tensor_verl_without_final_flush_s']:.3f} s median; timeshare's speed-up "
        f"over the faster alternative then: {flushless['digest_off']:.2f}x digest off, "
        f"{flushless['digest_on']:.2f}x digest on"
    )
    print("\nwhere the time goes (median seconds of one sync):")
    for name, spent in result["phases_median_s"].items():
        parts = ", ".join(f"{key} {value:.3f}" for key, value in spent.items())
        print(f"  {result['labels'][name]}: {parts}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mb", type=int, default=256, help="at least this many MiB")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--depth", type=int, default=2, help="timeshare's pipeline depth")
    parser.add_argument("--verl-bucket-mb", type=int, default=VERL_BUCKET_MB)
    parser.add_argument("--sweep", type=sweep_config, nargs="*", default=[], metavar="MiBxD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    runtime_dir = Path(tempfile.mkdtemp(prefix="ts-bench-", dir="/tmp"))
    shm_dir = Path(tempfile.mkdtemp(prefix="ts-bench-sglang-", dir="/dev/shm"))
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
