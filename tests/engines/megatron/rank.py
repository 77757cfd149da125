"""One rank of the Megatron trainer tests, as its own process (gloo over a loopback TCPStore):

    python -m tests.engines.megatron.rank train|logits|resume RANK WORLD PORT TP MODEL_DIR OUT_DIR

`train`: the logits of the loaded model (gathered over the vocabulary), then STEPS GRPO steps
on fixed batches (each rank its own), each committed to OUT_DIR/checkpoints; the losses, the
weights as SYNC sends them after each step, the offload round trip, and a second trainer that
resumes from the checkpoint. `logits`: the loaded model's logits alone. `resume`: a trainer of
WORLD ranks bootstrapped from OUT_DIR/checkpoints (written by another number of ranks), the
weights it sends. Each rank writes OUT_DIR/rank<r>.pt (`resume`: resumed<r>.pt) for the test.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from timeshare.engines.base import RolloutSample
from timeshare.engines.megatron.trainer import MegatronTrainer
from timeshare.engines.sharded_trainer import widened
from timeshare.engines.spec import EngineSpec, GrpoSpec, TaskSpec, engine_spec
from timeshare.protocols.weights.lent import LentTensor
from timeshare.task.vocab import EOS

GROUP = 4
PER_RANK = 8  # two groups of four
COMPLETION = 4  # the longest completion
# Each rank's completions' lengths, row by row: the ranks' batches have different widths (the
# TP group pads them to its widest before it gathers them), but each rank's minibatch (four
# rows) holds ten tokens, so that the token-mean loss of a TP=2 group's minibatch (over both
# ranks' rows) is the mean of two replicas' (each over its own rows).
LENGTHS = ([3, 3, 2, 2, 3, 2, 3, 2], [4, 1, 3, 2, 1, 4, 2, 3])
STEPS = 3
TASK = TaskSpec(group_size=GROUP, prompts_per_rank=2, max_completion_tokens=COMPLETION)
GRPO = GrpoSpec(lr=1e-3, weight_decay=0.01, minibatches=2)
SPEC_KEYS: dict[str, Any] = {"micro_batch_size": 2, "max_grad_norm": 0.5}
PROBE = torch.randint(0, 16, (3, 9), generator=torch.Generator().manual_seed(7))


def engine(model_dir: Path, tp: int) -> EngineSpec:
    return engine_spec(
        trainer="megatron",
        rollout="torch_ref",
        task=TASK,
        grpo=GRPO,
        megatron={"model_dir": str(model_dir), "tensor_parallel_size": tp, **SPEC_KEYS},
    )


def global_batch(seed: int, ranks: int, version: int) -> list[RolloutSample]:
    """`ranks` x PER_RANK samples of weight `version`, rewards varied within every group;
    completions of LENGTHS (every other one ending at EOS), prompts of 3 and 4 tokens on even
    ranks, 3 to 5 on odd ones."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(ranks * PER_RANK):
        rank, row = divmod(index, PER_RANK)
        prompt_length = 3 + row % (2 + rank % 2)
        prompt = torch.randint(0, 16, (prompt_length,), generator=generator).tolist()
        length = LENGTHS[rank % 2][row]
        tokens = torch.randint(0, 16, (length,), generator=generator).tolist()
        if row % 2:
            tokens[-1] = EOS
        logprobs = (-torch.rand(length, generator=generator) - 1.0).tolist()
        reward = float(index % GROUP == 0) + 0.25 * float(torch.rand(1, generator=generator))
        samples.append(
            RolloutSample(
                f"s{index}", tuple(tokens), tuple(logprobs), version, tuple(prompt), reward
            )
        )
    return samples


def rank_batch(seed: int, rank: int, ranks: int, version: int) -> list[RolloutSample]:
    return global_batch(seed, ranks, version)[rank * PER_RANK : (rank + 1) * PER_RANK]


def weights_out(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    """`iter_weights` as the weight channel takes it: a LentTensor written into a buffer of its
    scratch bytes (as into staging), a tensor as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, weight in trainer.iter_weights():
        if isinstance(weight, LentTensor):
            staging = torch.empty(weight.scratch_bytes, dtype=torch.uint8)
            weight.write_into(staging)
            out[name] = staging[: weight.nbytes].view(weight.dtype).view(weight.shape).clone()
        else:
            out[name] = weight.clone()
    return out


def full_logits(trainer: MegatronTrainer) -> torch.Tensor:
    """The model's logits of PROBE, the vocabulary gathered from the TP ranks."""
    positions = torch.arange(PROBE.shape[1]).expand_as(PROBE)
    with torch.no_grad():
        local: torch.Tensor = trainer.model(PROBE, positions, None).contiguous()
    if trainer.layout.tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(trainer.layout.tp)]
    dist.all_gather(parts, local, group=trainer.layout.tp_group)
    return torch.cat(parts, dim=-1)


def snapshot(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    """This rank's bytes of every parameter shard, gradient and optimiser state, copied."""
    out: dict[str, torch.Tensor] = {}
    for name, parameter in trainer.model.named_parameters():
        out[f"param/{name}"] = parameter.detach().clone()
        if parameter.grad is not None:
            out[f"grad/{name}"] = parameter.grad.clone()
        for key, value in trainer.optimizer.state.get(parameter, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"state/{name}/{key}"] = value.clone()
    return out


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def train(rank: int, world: int, tp: int, model_dir: Path, out_dir: Path) -> dict[str, Any]:
    checkpoints = out_dir / "checkpoints"
    trainer = MegatronTrainer(rank, world, engine(model_dir, tp))
    assert trainer.bootstrap(checkpoints / f"rank{rank}") == 0
    out: dict[str, Any] = {"logits": full_logits(trainer), "initial": weights_out(trainer)}
    # This rank's batch (its own widths, the other rank's differ) and each of its rows alone
    # (every call a collective of the TP group, whose ranks pad to the group's widths).
    batch = rank_batch(0, rank, world, version=0)
    out["batch_logprobs"] = trainer.logprobs(batch)
    out["alone_logprobs"] = [trainer.logprobs([sample])[0] for sample in batch]
    out["losses"], out["weights"] = [], []
    for step in range(STEPS):
        figures = trainer.train_step(rank_batch(step + 1, rank, world, version=step))
        out["losses"].append(figures.loss)
        out["weights"].append(weights_out(trainer))
    # The offload round trip, with gradients present (a batch's, accumulated, not applied).
    trainer.onload()
    data = trainer.prepare(rank_batch(9, rank, world, version=STEPS))
    trainer.optimizer.zero_grad()
    new = trainer._logprobs(trainer.model, data.sequences.select(slice(0, 2)))
    new = widened(new, data.sequences.widths[1])
    trainer.loss(new, data, slice(0, 2))[0].backward()  # type: ignore[no-untyped-call]
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
    # A second trainer of this job resumes from the committed step.
    again = MegatronTrainer(rank, world, engine(model_dir, tp))
    out["resumed_step"] = again.bootstrap(checkpoints / f"rank{rank}")
    out["resumed"] = weights_out(again)
    # One more step from the resumed optimiser state and from the one that never stopped:
    # the same bytes only if AdamW's moments and step count came back whole.
    for each in (trainer, again):
        each.train_step(rank_batch(STEPS + 1, rank, world, version=STEPS))
    out["next_step"], out["next_step_resumed"] = weights_out(trainer), weights_out(again)
    out["final_logits"] = full_logits(again)  # of the last step committed (STEPS + 1)
    return out


def resume(rank: int, world: int, tp: int, model_dir: Path, out_dir: Path) -> dict[str, Any]:
    trainer = MegatronTrainer(rank, world, engine(model_dir, tp))
    step = trainer.bootstrap(out_dir / "checkpoints" / f"rank{rank}")
    return {"step": step, "weights": weights_out(trainer)}


def logits(rank: int, world: int, tp: int, model_dir: Path) -> dict[str, Any]:
    trainer = MegatronTrainer(rank, world, engine(model_dir, tp))
    trainer.parallel_join()
    trainer.build()
    return {"logits": full_logits(trainer)}


def main() -> None:
    scenario, rank, world, port, tp, model_dir, out_dir = sys.argv[1:8]
    torch.set_num_threads(1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", int(port), int(world), int(rank) == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    args = (int(rank), int(world), int(tp), Path(model_dir))
    if scenario == "train":
        out, name = train(*args, Path(out_dir)), f"rank{rank}.pt"
    elif scenario == "resume":
        out, name = resume(*args, Path(out_dir)), f"resumed{rank}.pt"
    else:
        out, name = logits(*args), f"rank{rank}.pt"
    torch.save(out, Path(out_dir) / name)
    os._exit(0)  # gloo's threads need no orderly goodbye once the results are written


if __name__ == "__main__":
    main()
