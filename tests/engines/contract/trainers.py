"""Each trainer engine as the contract suite drives it: built through the registry, bootstrapped
from its checkpoint directory, its weights sent through the real weight channel into a rollout
engine built through the registry, and its state read without asking the engine's own
accounting (the model's parameters and the optimiser's state, by name; their storages, weakly
held).

The FSDP trainer runs in this process as a world of one rank (gloo over the harness's own job
store): every collective, the all-gathers into staging included, is real; only the ranks are few.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from tests.engines.contract.channel import TRANSFER, Channel, Outcome
from tests.engines.contract.rollouts import (
    COMPLETION,
    KV_CACHE_LEN,
    MODEL,
    TASK,
    Storages,
)
from timeshare.engines.base import RolloutEngine, RolloutSample, TrainerEngine
from timeshare.engines.context import EngineContext
from timeshare.engines.fsdp.trainer import FsdpTrainer
from timeshare.engines.inlet import WeightInlet
from timeshare.engines.megatron.trainer import MegatronTrainer
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.model_dir import ModelShape
from timeshare.engines.pairs import build_rollout, build_trainer
from timeshare.engines.spec import EngineSpec, engine_spec
from timeshare.engines.task import TaskWorkload
from timeshare.engines.torch_ref.model import init_model
from timeshare.engines.torch_ref.trainer import TorchRefTrainer
from timeshare.protocols.store import JobStore
from timeshare.task.vocab import BOS, DIGITS, EOS, PROMPT_DIGITS, SEP

# MODEL as `timeshare model init` writes it (the FSDP trainer's model directory).
SHAPE = ModelShape(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=2, vocab=16)
Tensors = dict[str, torch.Tensor]


def copied(named: Any) -> Tensors:
    return {name: tensor.detach().clone() for name, tensor in named}


class TrainerHarness:
    """One trainer engine, bootstrapped at step 0, and a rollout engine to send its weights to."""

    kind = ""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.directory = Path(tempfile.mkdtemp(prefix=f"ts-t{self.kind[:3]}-", dir="/tmp"))
        self.checkpoint_dir = self.directory / "checkpoints" / "rank0"
        self.store = JobStore.host()
        self.trainers: list[TrainerEngine] = []
        self.channel: Channel | None = None
        self.receiver: tuple[RolloutEngine, WeightInlet] | None = None
        try:
            self.engine = self.another()
            assert self.engine.bootstrap(self.checkpoint_dir) == 0
        except BaseException:
            self.close()
            raise

    def another(self) -> TrainerEngine:
        """A new trainer of this job, through the registry (not bootstrapped)."""
        context = EngineContext(spec=self.spec, rank=0, world_size=1, store=self.store)
        trainer = build_trainer(context)
        self.trainers.append(trainer)
        return trainer

    # -- what the trainer holds, read without its own accounting ------------------------------

    def initial_weights(self) -> Tensors:
        """The weights the job starts from, read from where they come from."""
        raise NotImplementedError

    def parameters(self, trainer: TrainerEngine) -> Tensors:
        """The model's parameters now, whole, by name (the trainer must hold them)."""
        raise NotImplementedError

    def state(self, trainer: TrainerEngine) -> Tensors:
        """This rank's bytes of every parameter, gradient and optimiser state, by name."""
        raise NotImplementedError

    def held_tensors(self, trainer: TrainerEngine) -> list[torch.Tensor]:
        """The tensors whose memory the trainer holds on its device."""
        raise NotImplementedError

    def witness(self, trainer: TrainerEngine) -> Storages:
        return Storages(self.held_tensors(trainer))

    # -- a batch ------------------------------------------------------------------------------

    def batch(
        self, trainer: TrainerEngine, lengths: Sequence[int] | None = None
    ) -> list[RolloutSample]:
        """Whole groups of the task at the trainer's version (prompts of differing lengths),
        completions of `lengths` tokens (by default 1 to COMPLETION, in a varying order: every
        minibatch as wide as the batch), every other one stopped at EOS, scored, with the
        trainer's own logprobs of their tokens (as a rollout of its weights reports them)."""
        workload = TaskWorkload(self.spec.task)
        requests = workload.requests(0, trainer.step)
        generator = torch.Generator().manual_seed(trainer.step)
        if lengths is None:
            lengths = [1 + (index * 3) % COMPLETION for index in range(len(requests))]
        drafts = [
            varied(request.request_id, request.prompt_tokens, length, trainer.step, generator)
            for request, length in zip(requests, lengths, strict=True)
        ]
        trainer.onload()  # (the reference trainer computes logprobs only with its parameters)
        logprobs = trainer.logprobs(drafts)
        return [
            dataclasses.replace(draft, logprobs=values, reward=workload.score(request, draft))
            for request, draft, values in zip(requests, drafts, logprobs, strict=True)
        ]

    # -- SYNC -----------------------------------------------------------------------------------

    def sync(self, trainer: TrainerEngine) -> tuple[Outcome, RolloutEngine]:
        """SYNC as the two workers run it: the trainer's weights (version: its step) into a
        reference rollout engine of the job's model; then the trainer's parameters offloaded."""
        rollout, inlet = self._receiver()

        def receive() -> Any:
            rollout.begin_weight_update()
            rollout.wake({"weights"})
            return inlet.receive(lambda: None)

        assert self.channel is not None
        trainer.prepare_sync()
        outcome = self.channel.transfer(trainer.iter_weights(), trainer.step, receive)
        trainer.finish_sync()
        trainer.offload_params()
        return outcome, rollout

    def _receiver(self) -> tuple[RolloutEngine, WeightInlet]:
        """The job's rollout engine (the reference one serves every causal LM trainer)."""
        if self.receiver is None:
            self.channel = Channel(prefix=f"ts-s{self.kind[:3]}-")
            context = EngineContext(
                spec=self.spec,
                rank=0,
                world_size=1,
                store=self.store,
                runtime_dir=self.channel.runtime_dir,
            )
            rollout = build_rollout(context)
            self.receiver = rollout, rollout.open_inlet(self.channel.endpoint, TRANSFER)
        return self.receiver

    def close(self) -> None:
        try:
            if self.channel is not None:
                self.channel.close_sender()
            if self.receiver is not None:
                self.receiver[1].close()
                self.receiver[0].close()
            if self.channel is not None:
                self.channel.close()
        finally:
            for trainer in self.trainers:
                trainer.close()
            shutil.rmtree(self.directory, ignore_errors=True)


class TorchRefHarness(TrainerHarness):
    kind = "torch_ref"

    def __init__(self) -> None:
        super().__init__(
            engine_spec(
                trainer="torch_ref",
                rollout="torch_ref",
                task=TASK,
                torch_ref={"model": MODEL, "seed": 0, "kv_cache_len": KV_CACHE_LEN},
            )
        )

    def initial_weights(self) -> Tensors:
        return copied(init_model(ModelConfig(**MODEL), seed=0).named_parameters())

    def parameters(self, trainer: TrainerEngine) -> Tensors:
        return copied(reference(trainer).model.named_parameters())

    def state(self, trainer: TrainerEngine) -> Tensors:
        trainer = reference(trainer)
        return named_state(trainer.model, trainer.optimizer, lambda tensor: tensor)

    def held_tensors(self, trainer: TrainerEngine) -> list[torch.Tensor]:
        trainer = reference(trainer)
        return held(trainer.model, trainer.optimizer, lambda tensor: tensor)


class FsdpHarness(TrainerHarness):
    kind = "fsdp"

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        super().__init__(
            engine_spec(
                trainer="fsdp",
                rollout="torch_ref",
                task=TASK,
                fsdp={"model_dir": str(model_dir)},
                torch_ref={"kv_cache_len": KV_CACHE_LEN},
            )
        )

    def initial_weights(self) -> Tensors:
        return load_file(self.model_dir / "model.safetensors")

    def parameters(self, trainer: TrainerEngine) -> Tensors:
        return copied(
            (name, p.full_tensor() if isinstance(p, DTensor) else p)
            for name, p in fsdp(trainer).module.named_parameters()
        )

    def state(self, trainer: TrainerEngine) -> Tensors:
        trainer = fsdp(trainer)
        return named_state(trainer.module, trainer.optimizer, local)

    def held_tensors(self, trainer: TrainerEngine) -> list[torch.Tensor]:
        trainer = fsdp(trainer)
        return held(trainer.module, trainer.optimizer, local)


class MegatronHarness(TrainerHarness):
    """The Megatron trainer as a world of one rank (tensor-parallel size 1): megatron's
    process groups, forward and vocab-parallel cross entropy are real; TP=2 is proven by the
    processes of tests/engines/megatron."""

    kind = "megatron"

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        super().__init__(
            engine_spec(
                trainer="megatron",
                rollout="torch_ref",
                task=TASK,
                megatron={"model_dir": str(model_dir)},
                torch_ref={"kv_cache_len": KV_CACHE_LEN},
            )
        )

    def initial_weights(self) -> Tensors:
        return load_file(self.model_dir / "model.safetensors")

    def parameters(self, trainer: TrainerEngine) -> Tensors:
        trainer = megatron(trainer)
        hf = {name: w for name, w in trainer.iter_weights()}
        return {
            name: w.materialize() if not isinstance(w, torch.Tensor) else w.clone()
            for name, w in hf.items()
        }

    def state(self, trainer: TrainerEngine) -> Tensors:
        trainer = megatron(trainer)
        return named_state(trainer.model, trainer.optimizer, lambda tensor: tensor)

    def held_tensors(self, trainer: TrainerEngine) -> list[torch.Tensor]:
        trainer = megatron(trainer)
        return held(trainer.model, trainer.optimizer, lambda tensor: tensor)


def varied(
    request_id: str,
    prompt: tuple[int, ...],
    length: int,
    version: int,
    generator: torch.Generator,
) -> RolloutSample:
    """A draft sample (logprobs 0.0) of `prompt`: `length` random digits, the last one EOS
    when the length is even (completions that stopped, and completions that ran out)."""
    tokens = torch.randint(0, DIGITS, (length,), generator=generator).tolist()
    if length % 2 == 0:
        tokens[-1] = EOS
    return RolloutSample(request_id, tuple(tokens), (0.0,) * length, version, prompt)


def uneven_batch(version: int) -> list[RolloutSample]:
    """Samples whose prompts (3 to 5 tokens) and completions (1 to COMPLETION, some ending at
    EOS) differ in length, in an order where neither is sorted: as a batch, right-padded."""
    generator = torch.Generator().manual_seed(11)
    prompts = [(BOS, *[digit] * (1 + digit % PROMPT_DIGITS), SEP) for digit in (4, 2, 9, 0, 7, 5)]
    return [
        varied(f"u{index}", prompt, 1 + (index * 3) % COMPLETION, version, generator)
        for index, prompt in enumerate(prompts)
    ]


def megatron(trainer: TrainerEngine) -> MegatronTrainer:
    assert isinstance(trainer, MegatronTrainer)
    return trainer


def reference(trainer: TrainerEngine) -> TorchRefTrainer:
    assert isinstance(trainer, TorchRefTrainer)
    return trainer


def fsdp(trainer: TrainerEngine) -> FsdpTrainer:
    assert isinstance(trainer, FsdpTrainer)
    return trainer


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes of `tensor` (a DTensor's local shard)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def named_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    bytes_of: Callable[[torch.Tensor], torch.Tensor],
) -> Tensors:
    out: Tensors = {}
    for name, parameter in model.named_parameters():
        out[f"param/{name}"] = bytes_of(parameter).detach().clone()
        if parameter.grad is not None:
            out[f"grad/{name}"] = bytes_of(parameter.grad).clone()
        for key, value in optimizer.state.get(parameter, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"state/{name}/{key}"] = bytes_of(value).clone()
    return out


def held(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    bytes_of: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    tensors = [bytes_of(p) for p in model.parameters()]
    tensors += [bytes_of(p.grad) for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [bytes_of(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaNs and signed zeros included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))
    )
