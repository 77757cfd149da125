"""What each rank's device holds in each phase of the cycle, part by part.

Every rank of a job holds the same (the trainers shard evenly, a rollout engine spans equal
groups), so one column per phase says it for all. Each part says how it is known:

    exact     from the model's sizes and the config (parameters, gradients, AdamW, staging,
              rollout weights, a KV cache set as a size)
    bound     an upper bound (FSDP's gathered layers, the tensor gathered whole at SYNC)
    estimate  activations of one micro-batch (Korthikanti et al. 2022, without recomputation,
              with a fused attention kernel), a rough figure: a framework's own temporaries
              come on top

The cycle decides what is where (docs/phase-machine.md): TRAIN holds the trainer's whole state
while the rollout sleeps (its device memory released: vLLM's sleep mode, SGLang's
release_memory); OFFLOAD moves gradients and AdamW to the host; SYNC wakes the rollout's weights
beside the trainer's parameters and the channel's staging; after SYNC the parameters go to the
host too; RESUME brings the rollout's KV cache back for ROLLOUT.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from timeshare.capacity.model_size import ModelSize
from timeshare.engines.footprint import RolloutFootprint, TrainerFootprint

GIB = float(1 << 30)
PHASES = ("train", "offload", "sync", "barrier", "resume", "rollout")
TRAINING = frozenset({"train"})
TRAINER_HELD = frozenset({"train", "offload", "sync"})
ROLLOUT_AWAKE = frozenset({"sync", "barrier", "resume", "rollout"})
SERVING = frozenset({"resume", "rollout"})

Kind = Literal["exact", "bound", "estimate"]


class Part(NamedTuple):
    name: str
    bytes: float
    phases: frozenset[str]
    kind: Kind


class Workload(NamedTuple):
    """What one rank trains on and generates per step (from [engine.task], [engine.grpo])."""

    sequences: int  # a rank's batch
    minibatches: int
    sequence_tokens: int  # a prompt and its completion


class Staging(NamedTuple):
    buffer_bytes: int
    depth: int
    on_device: bool  # CUDA IPC staging; shm staging lives on the host


def device_parts(  # noqa: PLR0917 - the plan's six inputs, each of its own kind
    model: ModelSize,
    trainer: TrainerFootprint,
    rollout: RolloutFootprint,
    work: Workload,
    staging: Staging,
    device_bytes: float,
) -> list[Part]:
    """Every part one rank's device holds, with the phases it is there in."""
    params = model.parameters
    shards, moments = trainer.parameter_shards, trainer.optimizer_shards
    parts = [
        Part(
            f"trainer parameters (float32, 1/{shards})", 4 * params / shards, TRAINER_HELD, "exact"
        ),
        Part(f"gradients (float32, 1/{shards})", 4 * params / shards, TRAINING, "exact"),
        Part(f"AdamW moments (2 x float32, 1/{moments})", 8 * params / moments, TRAINING, "exact"),
    ]
    if trainer.gathers_layers:
        gathered = (2 * model.largest_layer + model.edge) * trainer.compute_bytes
        parts.append(Part("gathered layers (2 + embeddings/head)", gathered, TRAINING, "bound"))
    parts.append(
        Part(
            f"activations ({micro_batch(trainer, work)} x {work.sequence_tokens} tokens)",
            activation_bytes(model, trainer, work),
            TRAINING,
            "estimate",
        )
    )
    if staging.on_device:
        parts.append(
            Part(
                f"staging ({staging.depth} x {staging.buffer_bytes / GIB:.2f} GiB buckets)",
                staging.depth * staging.buffer_bytes,
                frozenset({"sync"}),
                "exact",
            )
        )
    parts.append(
        Part(
            "largest tensor gathered whole",
            model.largest_tensor * trainer.sync_bytes / trainer.tensor_parallel,
            frozenset({"sync"}),
            "bound",
        )
    )
    weights = rollout_weight_bytes(model, rollout)
    parts.append(
        Part(f"rollout weights (1/{rollout.tensor_parallel})", weights, ROLLOUT_AWAKE, "exact")
    )
    parts.append(Part("KV cache", kv_cache_bytes(model, rollout, device_bytes), SERVING, "exact"))
    return parts


def phase_totals(parts: list[Part]) -> dict[str, float]:
    return {phase: sum(p.bytes for p in parts if phase in p.phases) for phase in PHASES}


def offloaded(parts: list[Part]) -> dict[str, float]:
    """What leaves the device for the host, by the phase that moves it."""
    moved = {"offload": 0.0, "sync": 0.0}
    for part in parts:
        if part.phases == TRAINING and part.kind == "exact":
            moved["offload"] += part.bytes  # gradients and AdamW
        elif part.phases == TRAINER_HELD:
            moved["sync"] += part.bytes  # the parameters, once sent
    return moved


def micro_batch(trainer: TrainerFootprint, work: Workload) -> int:
    minibatch = work.sequences // work.minibatches
    return min(trainer.micro_batch or minibatch, minibatch)


def activation_bytes(model: ModelSize, trainer: TrainerFootprint, work: Workload) -> float:
    """Stored activations of one micro-batch's forward, per rank: per layer s*b*h*34 bytes in
    16-bit, the MLP's share scaled to its width, split over the tensor-parallel group; and the
    float32 logits with their gradient. No attention scores (5*a*s^2*b): a fused attention
    kernel (flash, SDPA) keeps none."""
    b, s, h = micro_batch(trainer, work), work.sequence_tokens, model.hidden
    mlp_share = 19 * model.mlp_active / (4 * h)
    per_layer = s * b * h * (15 + mlp_share)
    layers = model.layers * per_layer * trainer.compute_bytes / 2
    logits = 2 * b * s * model.vocab * 4
    return (layers + logits) / trainer.tensor_parallel


def rollout_weight_bytes(model: ModelSize, rollout: RolloutFootprint) -> float:
    return model.parameters * element_bytes(model, rollout) / rollout.tensor_parallel


def element_bytes(model: ModelSize, rollout: RolloutFootprint) -> int:
    """Bytes of one weight (and one KV element) as the rollout holds it: its dtype, or for
    "auto" the model's own (float32 when the config names none)."""
    return rollout.weight_bytes or model.dtype_bytes or 4


def kv_cache_bytes(model: ModelSize, rollout: RolloutFootprint, device_bytes: float) -> float:
    """The KV cache on one rank: a size, tokens, or what the engine's share of the device
    leaves beside its weights (never below 0)."""
    if rollout.kv_cache_bytes is not None:
        return rollout.kv_cache_bytes
    if rollout.kv_cache_tokens is not None:
        per_token = model.kv_bytes_per_token(element_bytes(model, rollout), rollout.tensor_parallel)
        return rollout.kv_cache_tokens * per_token
    fraction = rollout.memory_fraction or 0.0
    return max(0.0, fraction * device_bytes - rollout_weight_bytes(model, rollout))


def kv_cache_tokens(model: ModelSize, rollout: RolloutFootprint, device_bytes: float) -> int:
    """Tokens the KV cache holds."""
    per_token = model.kv_bytes_per_token(element_bytes(model, rollout), rollout.tensor_parallel)
    return int(kv_cache_bytes(model, rollout, device_bytes) // per_token)
