"""One rank of the FSDP trainer tests, as its own process (gloo over a loopback TCPStore):

    python -m tests.engines.fsdp.rank train|memory RANK WORLD PORT MODEL_DIR OUT_DIR

`train`: the trainer's loss, gradients and one AdamW step on this rank's half of a batch; its
weights before and after; the offload round trip. `memory`: the peak extra memory of gathering a
model whose layers differ in size, streamed into a bucket (as the weight channel does) and
listed whole. Each writes `OUT_DIR/rank<r>.pt` for the test to compare.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from timeshare.engines.base import RolloutSample
from timeshare.engines.fsdp.gather import gathered_parameters, lent_parameters
from timeshare.engines.fsdp.trainer import FsdpTrainer
from timeshare.engines.host_memory import local
from timeshare.engines.spec import EngineSpec, GrpoSpec, TaskSpec, engine_spec
from timeshare.protocols.weights.layout import BucketPlanner, pack
from timeshare.protocols.weights.lent import LentTensor
from timeshare.task.vocab import EOS

GROUP = 4
PER_RANK = 8  # two groups of four
COMPLETION = 4  # the longest completion; prompts of 3 to 5 tokens, completions of 1 to 4
TASK = TaskSpec(group_size=GROUP, prompts_per_rank=2, max_completion_tokens=COMPLETION)
GRPO = GrpoSpec(lr=1e-3, weight_decay=0.01, minibatches=1)
SPEC_KEYS: dict[str, Any] = {"micro_batch_size": 2, "max_grad_norm": 0.5}
MIB = 2**20
# The memory model: layers of 4, 16 and 48 MiB (fp32 Linear weights [out, in]), 132 MiB in all;
# a bucket of 8 MiB, so that a small layer is lent staging and a large one is gathered whole.
MEMORY_LAYERS = [(1024, 1024), (4096, 1024), (1024, 4096), (12288, 1024), (1024, 12288)]
BUCKET_BYTES = 8 * MIB


def engine(model_dir: Path, **fsdp: Any) -> EngineSpec:
    """The job's `[engine]`: the FSDP trainer of `model_dir` (`[engine.fsdp]`: `fsdp`) on TASK
    and GRPO, the reference rollout serving it."""
    return engine_spec(
        trainer="fsdp",
        rollout="torch_ref",
        task=TASK,
        grpo=GRPO,
        fsdp={"model_dir": str(model_dir), **fsdp},
    )


def global_batch(seed: int, ranks: int) -> list[RolloutSample]:
    """`ranks` x PER_RANK samples of weight version 0, rewards varied within every group;
    prompts of 3, 4 and 5 tokens, completions of 1 to COMPLETION tokens, every other one
    ending at EOS (each rank's batch right-padded, rows of every length)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(ranks * PER_RANK):
        prompt = torch.randint(0, 16, (3 + index % 3,), generator=generator).tolist()
        length = 1 + (index * 3) % COMPLETION
        tokens = torch.randint(0, 16, (length,), generator=generator).tolist()
        if index % 2:
            tokens[-1] = EOS
        reward = float(index % GROUP == 0) + 0.25 * float(torch.rand(1, generator=generator))
        samples.append(
            RolloutSample(f"s{index}", tuple(tokens), (-1.0,) * length, 0, tuple(prompt), reward)
        )
    return samples


def rank_batch(seed: int, rank: int, ranks: int) -> list[RolloutSample]:
    return global_batch(seed, ranks)[rank * PER_RANK : (rank + 1) * PER_RANK]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def weights_out(trainer: FsdpTrainer, gather: str) -> dict[str, torch.Tensor]:
    """`iter_weights` as the weight channel takes it: a LentTensor written into a buffer of its
    scratch bytes (as into staging), a tensor as it is."""
    trainer.spec = msgspec.structs.replace(trainer.spec, sync_gather=gather)
    out: dict[str, torch.Tensor] = {}
    for name, weight in trainer.iter_weights():
        if isinstance(weight, LentTensor):
            staging = torch.empty(weight.scratch_bytes, dtype=torch.uint8)
            weight.write_into(staging)
            out[name] = staging[: weight.nbytes].view(weight.dtype).view(weight.shape).clone()
        else:
            out[name] = weight.clone()
    return out


def snapshot(trainer: FsdpTrainer) -> dict[str, torch.Tensor]:
    """This rank's bytes of every parameter shard, gradient and optimiser state, copied."""
    out: dict[str, torch.Tensor] = {}
    for name, parameter in trainer.module.named_parameters():
        out[f"param/{name}"] = local(parameter).detach().clone()
        if parameter.grad is not None:
            out[f"grad/{name}"] = local(parameter.grad).clone()
        for key, value in trainer.optimizer.state.get(parameter, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"state/{name}/{key}"] = local(value).clone()
    return out


def train(rank: int, world: int, model_dir: Path) -> dict[str, Any]:
    trainer = FsdpTrainer(rank, world, engine(model_dir, **SPEC_KEYS))
    trainer.build()
    out: dict[str, Any] = {"initial": weights_out(trainer, "into_staging")}
    data = trainer.prepare(rank_batch(1, rank, world))
    out["loss"], _ = trainer.accumulate_gradients(data, range(PER_RANK))
    parameters = trainer.module.named_parameters()
    out["grads"] = {n: full(p.grad) for n, p in parameters if p.grad is not None}
    trainer.apply_gradients()
    out["stepped"] = weights_out(trainer, "into_staging")
    out["stepped_then_pack"] = weights_out(trainer, "then_pack")
    reference = get_model_state_dict(
        trainer.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out["full_state_dict"] = reference
    # The offload round trip, with gradients present (a second batch's, not yet applied).
    trainer.accumulate_gradients(trainer.prepare(rank_batch(2, rank, world)), range(PER_RANK))
    before = snapshot(trainer)
    out["held_mb"] = [trainer.held_mb()]
    trainer.offload()
    out["held_mb"].append(trainer.held_mb())
    trainer.offload_params()
    out["held_mb"].append(trainer.held_mb())
    trainer.onload()
    after = snapshot(trainer)
    out["roundtrip"] = {
        key: _bytes(before[key]).equal(_bytes(after.get(key, torch.empty(0)))) for key in before
    }
    out["roundtrip_keys"] = sorted(before)
    return out


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def peak_extra_mb(consume: Any) -> float:
    """Peak resident memory above the current while `consume()` runs (Linux's VmHWM, reset)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak to the current RSS
    base = _status_kb("VmRSS")
    consume()
    return (_status_kb("VmHWM") - base) / 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def memory(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(i, o, bias=False) for o, i in MEMORY_LAYERS))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    staging = torch.zeros(BUCKET_BYTES, dtype=torch.uint8)

    def streamed() -> None:  # what the weight sender does: plan buckets, pack each
        planner = BucketPlanner(BUCKET_BYTES)
        for name, tensor in gathered_parameters(model, dtype=torch.float32):
            for bucket in planner.add(name, tensor):
                pack(bucket, staging)
                bucket.pieces.clear()  # packed: its sources are free to go
            del tensor  # the planner holds what it has not packed yet
        for bucket in planner.finish():
            pack(bucket, staging)

    def lent() -> None:  # the default: each gather writes into the staging it is lent
        planner = BucketPlanner(BUCKET_BYTES)
        for name, weight in lent_parameters(model, dtype=torch.float32):
            for bucket in planner.add(name, weight):
                pack(bucket, staging)
                bucket.pieces.clear()
            del weight
        for bucket in planner.finish():
            pack(bucket, staging)

    def listed() -> None:  # what the worker did before: every weight gathered first
        weights = list(gathered_parameters(model, dtype=torch.float32))
        assert len(weights) == len(MEMORY_LAYERS)

    return {
        "streamed_mb": peak_extra_mb(streamed),
        "lent_mb": peak_extra_mb(lent),
        "listed_mb": peak_extra_mb(listed),
        "largest_mb": max(o * i * 4 for o, i in MEMORY_LAYERS) / MIB,
        "total_mb": sum(o * i * 4 for o, i in MEMORY_LAYERS) / MIB,
        "bucket_mb": BUCKET_BYTES / MIB,
    }


def main() -> None:
    scenario, rank, world, port, model_dir, out_dir = sys.argv[1:7]
    torch.set_num_threads(1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", int(port), int(world), int(rank) == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    try:
        if scenario == "train":
            out = train(int(rank), int(world), Path(model_dir))
        else:
            out = memory(int(rank), int(world))
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads need no orderly goodbye once the results are written


if __name__ == "__main__":
    main()
