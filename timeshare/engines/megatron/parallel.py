"""The trainer's process groups: the job's trainer ranks as one torch.distributed world, split
by megatron-core's `parallel_state` into tensor-parallel groups of consecutive ranks and
data-parallel groups across them.

`parallel_state` is process-wide: a process holds one layout at a time. `join` sets it up (or
finds it already set up with the same tensor-parallel size: several trainers of one process,
as the in-process tests build), `leave` tears it down with the process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from timeshare.errors import ConfigError
from timeshare.protocols.store import JobStore

STORE_PREFIX = "megatron/trainers/"


@dataclass(frozen=True)
class Layout:
    """Where this rank stands: its tensor-parallel rank and group, its data-parallel ones."""

    rank: int
    world: int
    tp: int

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp  # megatron's default order puts TP fastest

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return parallel_state.get_tensor_model_parallel_group() if self.world > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return parallel_state.get_data_parallel_group() if self.world > 1 else None


def join(
    layout: Layout,
    device: torch.device,
    store: JobStore | None,
    timeout_s: float,
    seed: int,
) -> None:
    """This process into the trainers' world and megatron's groups (idempotent)."""
    if layout.world % layout.tp:
        raise ConfigError(
            f"engine.megatron.tensor_parallel_size ({layout.tp}) does not divide the "
            f"{layout.world} trainer ranks"
        )
    if not dist.is_initialized():
        assert store is not None, "the Megatron trainer needs the job store"
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store.prefixed(STORE_PREFIX),
            rank=layout.rank,
            world_size=layout.world,
            timeout=timedelta(seconds=timeout_s),
        )
    if parallel_state.model_parallel_is_initialized():
        held = parallel_state.get_tensor_model_parallel_world_size()
        if held != layout.tp:
            raise ConfigError(
                f"this process already holds megatron's groups for tensor_parallel_size {held}, "
                f"not {layout.tp}"
            )
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        distributed_timeout_minutes=timeout_s / 60,  # the job's deadline, not rounded
    )
    # On a CPU, the inference tracker's fork() is a no-op: the CUDA RNG tracker would swap
    # CUDA RNG states (cpu.py). On GPUs, megatron's own tracker.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=device.type == "cpu")


def leave() -> None:
    """Megatron's groups and the process group torn down (the process may join again)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
