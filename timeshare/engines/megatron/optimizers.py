"""How the Megatron trainer turns a minibatch's gradients into a step, on each kind of device.

    HostAdamW       a CPU: torch's AdamW over this rank's shards, the gradients all-reduced
                    over the data-parallel group and clipped over the whole model
    DistributedAdam CUDA: megatron's DistributedDataParallel (gradients in contiguous buffers,
                    reduce-scattered over the data-parallel group) and its distributed optimizer
                    (each replica keeps the fp32 master weights and Adam state of its share)

megatron's DDP and optimizers allocate on CUDA and check `torch.cuda` tensor types, so a CPU
cannot run them; the trainer talks to either through the same few calls: the module to run
forward, `zero_grad`, `step` (after the micro-batches' backward), the tensors OFFLOAD moves, and
the state a checkpoint keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from timeshare.engines.megatron.parallel import Layout
from timeshare.engines.spec import GrpoSpec
from timeshare.errors import CheckpointError

BETAS = (0.9, 0.99)  # every trainer's AdamW (torch_ref's, FSDP's)


class Optimizing(ABC):
    """A model's optimiser, and the gradient reduction that comes before its step."""

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """What runs forward (the model, or megatron's DDP around it)."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def step(self) -> dict[str, float]:
        """Reduce the gradients of the micro-batches run since `zero_grad`, clip, step;
        figures (the gradient norm before clipping)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of gradients and optimiser state (what OFFLOAD moves)."""

    @abstractmethod
    def shared_state(self) -> dict[str, Any]:
        """Optimiser state of this TP rank, whole (written once per TP rank, by the first
        replica). Every rank calls it: it may gather from the replicas."""

    @abstractmethod
    def load(self, shared: dict[str, Any]) -> None:
        """Restore what `shared_state` returned (every rank calls it: it may scatter)."""


class HostAdamW(Optimizing):
    def __init__(self, model: GPTModel, layout: Layout, grpo: GrpoSpec, max_grad_norm: float):
        self.model = model
        self.layout = layout
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=grpo.lr, weight_decay=grpo.weight_decay, betas=BETAS
        )

    @property
    def module(self) -> torch.nn.Module:
        module: torch.nn.Module = self.model
        return module

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> dict[str, float]:
        self._average_gradients()
        metrics = {}
        if self.max_grad_norm > 0:
            metrics["grad_norm"] = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def tensors(self) -> list[torch.Tensor]:
        tensors = [p.grad for p in self.model.parameters() if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def shared_state(self) -> dict[str, Any]:
        return {"adamw": self.optimizer.state_dict()}

    def load(self, shared: dict[str, Any]) -> None:
        if "adamw" not in shared:
            raise CheckpointError("the checkpoint's optimiser state is not torch's AdamW's")
        self.optimizer.load_state_dict(shared["adamw"])
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # torch.load's storages are not resizable; OFFLOAD resizes (host_memory.py)
                if isinstance(value, torch.Tensor) and not value.untyped_storage().resizable():
                    state[key] = value.clone()

    def _average_gradients(self) -> None:
        """The data-parallel replicas' gradients averaged (one all-reduce of them all)."""
        if self.layout.dp == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.layout.dp_group)
        flat /= self.layout.dp
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _clip_gradients(self) -> float:
        """Clip to max_grad_norm over the whole model; the norm before. A TP-split parameter's
        shards are summed over the TP group, a replicated one (a norm) counted once."""
        counted = [
            p.grad
            for p in self.model.parameters()
            if p.grad is not None and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
        ]
        squares = torch.stack([g.detach().float().square().sum() for g in counted]).sum()
        if self.layout.tp > 1:
            dist.all_reduce(squares, group=self.layout.tp_group)
        norm = float(squares.sqrt())
        scale = self.max_grad_norm / (norm + 1e-6)
        if scale < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm


class DistributedAdam(Optimizing):
    """megatron's DDP and distributed optimizer (CUDA only: tests/engines/megatron/test_cuda.py,
    marked `gpu`)."""

    def __init__(
        self,
        model: GPTModel,
        grpo: GrpoSpec,
        max_grad_norm: float,
    ) -> None:
        # Imported here: their modules build CUDA state that a CPU trainer never needs.
        from megatron.core.distributed import (  # noqa: PLC0415
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: PLC0415

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True
        )
        self.ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        config = OptimizerConfig(
            optimizer="adam",
            lr=grpo.lr,
            weight_decay=grpo.weight_decay,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            clip_grad=max_grad_norm,
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(config, [self.ddp])

    @property
    def module(self) -> torch.nn.Module:
        module: torch.nn.Module = self.ddp
        return module

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict[str, float]:
        self.ddp.finish_grad_sync()
        _, grad_norm, _ = self.optimizer.step()
        return {} if grad_norm is None else {"grad_norm": float(grad_norm)}

    def _distributed(self) -> list[Any]:
        """The distributed optimizers under megatron's (one per parameter group kind)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def tensors(self) -> list[torch.Tensor]:
        tensors = [buffer.grad_data for buffer in self.ddp.buffers]
        for optimizer in self._distributed():
            inner = optimizer.optimizer  # torch's Adam over the fp32 master shards
            for group in inner.param_groups:
                tensors += list(group["params"])
            for state in inner.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        # fp32 parameters are their own master weights: those shards view the parameters'
        # buffer, which SYNC still reads after OFFLOAD (offload_params moves it, later)
        parameters = {p.untyped_storage()._cdata for p in self.ddp.module.parameters()}
        return [t for t in tensors if t.untyped_storage()._cdata not in parameters]

    def shared_state(self) -> dict[str, Any]:
        """The optimiser's groups and, gathered from every data-parallel replica onto the
        first (a collective: every rank calls it), its master weights and Adam state in
        megatron's DP-zero form (host tensors)."""
        return {
            "megatron": self.optimizer.state_dict(),
            "parameter_state": [o.get_parameter_state_dp_zero() for o in self._distributed()],
        }

    def load(self, shared: dict[str, Any]) -> None:
        """(A collective: the first replica's state is scattered to every replica.)"""
        if "megatron" not in shared or "parameter_state" not in shared:
            raise CheckpointError(
                "the checkpoint holds no distributed-optimizer state (written on a CPU?)"
            )
        self.optimizer.load_state_dict(shared["megatron"])
        for optimizer, state in zip(self._distributed(), shared["parameter_state"], strict=True):
            optimizer.load_parameter_state_from_dp_zero(state)
