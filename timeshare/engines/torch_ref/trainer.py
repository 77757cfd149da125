"""The reference trainer: GRPO with AdamW on the small causal LM, data-parallel over gloo.

"Device" state is what the engine computes with (parameters, optimiser state); `offload` and
`offload_params` move it to a separate host store and drop it, `onload` brings it back bit for
bit. On a CPU machine both live in host memory, so the bytes dropped are what the log reports as
freed. Every rank starts from the same weights and all-reduces its gradients, so the ranks stay
identical; each samples its own prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import structlog
import torch
import torch.distributed as dist

from timeshare.engines.base import RolloutSample
from timeshare.engines.digest import weights_digest
from timeshare.engines.grpo import (
    GrpoBatch,
    GrpoTrainer,
    completion_logprobs,
    figures_kept,
)
from timeshare.engines.handoff import COLLECTIVE_TIMEOUT_S
from timeshare.engines.host_memory import return_free_heap
from timeshare.engines.invariance import enable_strict_gemm
from timeshare.engines.sequences import Sequences, pack, unpadded
from timeshare.engines.spec import EngineChoice
from timeshare.engines.torch_ref import checkpoint
from timeshare.engines.torch_ref.model import CausalLM, init_model, load_pretrained
from timeshare.engines.torch_ref.spec import TorchRefSpec
from timeshare.protocols.store import JobStore
from timeshare.units import MIB

log = structlog.get_logger(__name__)


def initial_model(spec: TorchRefSpec, *, batch_invariant: bool = False) -> CausalLM:
    if spec.model_dir:
        model = load_pretrained(Path(spec.model_dir))
    else:
        model = init_model(spec.model, spec.seed)
    model.set_batch_invariant(batch_invariant)
    return model


class TorchRefTrainer(GrpoTrainer):
    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: EngineChoice,
        *,
        store: JobStore | None = None,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.spec = engine.settings("torch_ref", TorchRefSpec)
        self.task = engine.task
        self.grpo = engine.grpo
        self.store = store
        self.collective_timeout_s = collective_timeout_s
        self.batch_invariant = engine.batch_invariant
        if self.batch_invariant:
            enable_strict_gemm()  # before the first GEMM of this process
        self.model = initial_model(self.spec, batch_invariant=self.batch_invariant)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.grpo.lr,
            weight_decay=self.grpo.weight_decay,
            betas=(0.9, 0.99),
        )
        self.reference = (
            initial_model(self.spec, batch_invariant=self.batch_invariant)
            if self.grpo.kl_coef > 0
            else None
        )
        self.step = 0
        # The host's copies, allocated at the first offload and written in place after: a fresh
        # copy every step fragmented the heap (the trainer's RSS grew ~30 MiB per 1,000 steps).
        self.host_params: dict[str, torch.Tensor] = {}
        self.host_optimizer: dict[int, dict[str, object]] = {}  # tensors, and the step count
        self.params_offloaded = False
        self.optimizer_offloaded = False
        self.checkpoint_dir: Path | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def bootstrap(self, directory: Path) -> int:
        if self.world_size > 1 and not dist.is_initialized():
            assert self.store is not None, "a data-parallel trainer needs the job store"
            dist.init_process_group(
                "gloo",
                store=self.store.prefixed("torch_ref/trainers/"),
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.collective_timeout_s),
            )
        self.load_checkpoint(directory)
        self.offload()  # the optimiser waits in the host store until TRAIN
        return self.step

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- memory --------------------------------------------------------------------------------

    def onload(self) -> None:
        if self.params_offloaded:
            for name, parameter in self.model.named_parameters():
                parameter.data = self.host_params[name].clone()
            self.params_offloaded = False
        if self.optimizer_offloaded:
            params = list(self.model.parameters())
            for index, state in self.host_optimizer.items():
                self.optimizer.state[params[index]] = {k: _clone(v) for k, v in state.items()}
            self.optimizer_offloaded = False

    def offload(self) -> None:
        """Optimiser state and gradients to the host's copies; their device copies dropped."""
        if self.optimizer_offloaded:
            return
        freed = 0
        for index, parameter in enumerate(self.model.parameters()):
            state = self.optimizer.state.pop(parameter, None)
            if state:
                host = self.host_optimizer.setdefault(index, {})
                for key, value in state.items():
                    host[key] = _into(host.get(key), value)
                freed += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
            if parameter.grad is not None:
                freed += parameter.grad.nbytes
                parameter.grad = None
        self.optimizer_offloaded = True
        log.info("trainer.offload", rank=self.rank, freed_mb=round(freed / MIB, 3))

    def offload_params(self) -> None:
        if self.params_offloaded:
            return
        freed = 0
        for name, parameter in self.model.named_parameters():
            self.host_params[name] = _into_tensor(self.host_params.get(name), parameter.data)
            freed += parameter.data.nbytes
            parameter.data = torch.empty(0)
        self.params_offloaded = True
        return_free_heap()  # its device is this process's heap: empty now (host_memory.py)
        log.info("trainer.offload_params", rank=self.rank, freed_mb=round(freed / MIB, 3))

    def held_mb(self) -> float:
        held = sum(p.data.nbytes for p in self.model.parameters())
        held += sum(
            v.nbytes
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        return held / MIB

    # -- weights -------------------------------------------------------------------------------

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach()

    def digest(self) -> str:
        return weights_digest(self.iter_weights())

    # -- training ------------------------------------------------------------------------------

    def logprobs(self, batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        sequences = pack(batch)
        with torch.no_grad():
            values = self._logprobs(self.model, sequences)
        return unpadded(values, sequences)

    def policy_logprobs(self, sequences: Sequences) -> torch.Tensor:
        with torch.no_grad():
            return self._logprobs(self.model, sequences)

    def reference_logprobs(self, sequences: Sequences) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            return self._logprobs(self.reference, sequences)

    def update(self, data: GrpoBatch, rows: range) -> tuple[float, dict[str, float]]:
        part = slice(rows.start, rows.stop)
        new = self._logprobs(self.model, data.sequences.select(part))
        loss, metrics = self.loss(new, data, part)
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        self._average_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), metrics

    def commit(self) -> None:
        if self.checkpoint_dir is not None:
            self.save_checkpoint(self.checkpoint_dir)

    def _logprobs(self, model: CausalLM, sequences: Sequences) -> torch.Tensor:
        """[rows, completion_width]: the completions' logprobs (sequences.py's layout)."""
        logits = model(sequences.tokens[:, :-1])
        return completion_logprobs(logits, sequences, self.task.temperature)

    def _average_gradients(self) -> None:
        if self.world_size == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path) -> None:
        was_offloaded = self.params_offloaded
        self.onload()
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "data_position": self.step,  # prompts are a function of (seed, rank, step)
            "train": None if self.last_train is None else msgspec.to_builtins(self.last_train),
        }
        checkpoint.write(directory, self.step, state, keep=self.keep_checkpoints)
        if was_offloaded:
            self.offload_params()

    def load_checkpoint(self, directory: Path) -> None:
        """The newest step that every rank holds durably, or the initial model at step 0."""
        self.checkpoint_dir = directory
        step = checkpoint.committed_step(directory.parent, self.world_size)
        if step is None:
            self.step = 0
            return
        state = checkpoint.read(directory, step)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.last_train = figures_kept(state.get("train"))
        log.info("trainer.checkpoint.loaded", rank=self.rank, step=self.step)


def _clone(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _into(host: object, value: object) -> object:
    """An optimiser's state value for the host: a tensor as `_into_tensor` writes it, else
    itself (the step count)."""
    if not isinstance(value, torch.Tensor):
        return value
    return _into_tensor(host, value)


def _into_tensor(host: object, value: torch.Tensor) -> torch.Tensor:
    """`value` written into `host`, the host's copy kept from the last offload, where it has
    the same shape and dtype; a new copy where not (the first offload)."""
    if isinstance(host, torch.Tensor) and host.shape == value.shape and host.dtype == value.dtype:
        return host.copy_(value)
    return value.clone()


build = TorchRefTrainer.from_context  # the registry's builder (registry.py)
