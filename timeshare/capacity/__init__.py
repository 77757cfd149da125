"""`timeshare plan`: whether a job fits its cluster, worked out before anything runs.

From the config, the model's `config.json` alone (no weights) and the cluster's shape (`[cluster]`
nodes, ranks_per_node, device_gib, sync_gbps; or the command line's), the plan checks the rules
of rules.py and says, per phase, what each rank's device holds (memory.py), what OFFLOAD and SYNC
move to the host, and how long a SYNC's transfer takes against its deadline. No engine starts,
no engine library is asked (the config's probes are left out) and no accelerator is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import msgspec

from timeshare.capacity import memory, rules
from timeshare.capacity.memory import Part, Staging, Workload
from timeshare.capacity.model_size import ModelSize, count, model_size_of
from timeshare.capacity.rules import Problem, SyncFigures
from timeshare.cluster import ranks_per_node
from timeshare.config import LoadedConfig
from timeshare.engines.footprint import (
    HasRolloutFootprint,
    HasTrainerFootprint,
    RolloutFootprint,
    TrainerFootprint,
)
from timeshare.engines.model_config import TrainedModel
from timeshare.errors import ConfigError
from timeshare.state import Phase


class Plan(NamedTuple):
    nodes: int
    ranks_per_node: int
    ranks: int
    device_bytes: float
    sync_gbps: float
    model: ModelSize
    trainer: TrainerFootprint
    rollout: RolloutFootprint
    parts: list[Part]
    totals: dict[str, float]  # per phase, on each rank's device
    moved: dict[str, float]  # to the host, by the phase that moves it
    kv_tokens: int
    longest_sequence: int
    sync: SyncFigures
    problems: list[Problem]
    notes: list[str]

    @property
    def feasible(self) -> bool:
        return not self.problems


def plan_job(loaded: LoadedConfig) -> Plan:
    config = loaded.config
    engine = config.engine
    cluster = config.cluster
    per_node = ranks_per_node(cluster, config.job.ranks)
    trainer, rollout = footprints(loaded)
    model = model_size(engine.trained_model(), engine.trainer)
    device = cluster.device_gib * memory.GIB
    work = Workload(engine.task.batch_size, engine.grpo.minibatches, engine.task.sequence_tokens)
    staging = Staging(
        config.transfer.bucket_bytes,
        config.transfer.pipeline_depth,
        on_device=config.transfer.transport != "shm",
    )
    parts = memory.device_parts(model, trainer, rollout, work, staging, device)
    totals = memory.phase_totals(parts)
    longest = rollout.longest_sequence or model.max_positions or work.sequence_tokens
    kv_tokens = memory.kv_cache_tokens(model, rollout, device)
    sync = sync_figures(loaded, model, trainer)
    problems = [
        *rules.ranks_rules(per_node, trainer, rollout),
        *rules.heads_rules(model, trainer, rollout),
        *rules.memory_rules(parts, totals, device),
        *rules.kv_cache_rules(kv_tokens, longest, rollout),
        *rules.sync_rules(sync, cluster.sync_gbps),
    ]
    return Plan(
        nodes=cluster.nodes,
        ranks_per_node=per_node,
        ranks=config.job.ranks,
        device_bytes=device,
        sync_gbps=cluster.sync_gbps,
        model=model,
        trainer=trainer,
        rollout=rollout,
        parts=parts,
        totals=totals,
        moved=memory.offloaded(parts),
        kv_tokens=kv_tokens,
        longest_sequence=longest,
        sync=sync,
        problems=problems,
        notes=notes(rollout, staging),
    )


def footprints(loaded: LoadedConfig) -> tuple[TrainerFootprint, RolloutFootprint]:
    engine = loaded.config.engine
    trainer, rollout = engine.section(engine.trainer), engine.section(engine.rollout)
    if not isinstance(trainer, HasTrainerFootprint):
        raise ConfigError(
            f"engine.trainer = {engine.trainer!r} says nothing of what it holds on a device: "
            "there is nothing to plan"
        )
    if not isinstance(rollout, HasRolloutFootprint):
        raise ConfigError(
            f"engine.rollout = {engine.rollout!r} says nothing of what it holds on a device: "
            "there is nothing to plan"
        )
    return trainer.trainer_footprint(loaded.config.job.ranks), rollout.rollout_footprint(
        engine.task.batch_size
    )


def model_size(trained: TrainedModel | None, trainer: str) -> ModelSize:
    """From the model directory's config.json, where the trainer names one; else from the Llama
    keys the trainer gives."""
    if trained is None:
        raise ConfigError(f"engine.trainer = {trainer!r} trains no model: there is nothing to plan")
    if trained.directory:
        return model_size_of(Path(trained.directory) / "config.json")
    return count(msgspec.to_builtins(trained.config), trained.where)


def sync_figures(loaded: LoadedConfig, model: ModelSize, trainer: TrainerFootprint) -> SyncFigures:
    config = loaded.config
    rate = config.cluster.sync_gbps * 1e9
    sync_bytes = model.parameters * trainer.sync_bytes
    custom = Phase.SYNC.value in config.deadlines.commands
    return SyncFigures(
        bytes=sync_bytes,
        seconds=sync_bytes / rate,
        deadline_s=config.deadlines.for_command(Phase.SYNC.value),
        deadline_key="deadlines.commands.sync" if custom else "deadlines.phase_s",
        bucket_seconds=config.transfer.bucket_bytes / rate,
        ack_timeout_s=config.transfer.ack_timeout_s,
    )


def notes(rollout: RolloutFootprint, staging: Staging) -> list[str]:
    said = [
        "the rollout sleeps through TRAIN and OFFLOAD (CUDA: vLLM's sleep mode, SGLang's "
        "release_memory); where it cannot (CPU) its weights and KV cache stay on top",
    ]
    if rollout.tensor_parallel > 1:
        said.append(
            f"{rollout.tp_key} = {rollout.tensor_parallel}: one engine per group of "
            f"{rollout.tensor_parallel} ranks, each rank's device holding "
            f"1/{rollout.tensor_parallel} of the weights and KV cache; the group's first rank "
            "hosts it, and its trainer sends each bucket once to all the engine's TP workers"
        )
    if not staging.on_device:
        said.append("transfer.transport = shm: staging is on the host, not the device")
    return said
