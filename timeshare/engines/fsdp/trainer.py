"""The FSDP2 trainer: GRPO with AdamW on a transformers causal LM sharded with `fully_shard`.

Every rank loads the model from the local directory, then `fully_shard` shards each decoder
layer and the root (embeddings, final norm, head) over a 1-D mesh of the trainer ranks: gloo on
CPU, NCCL on CUDA. Each rank samples its own prompts; FSDP averages the gradients across ranks,
so one optimiser step sees the whole job's batch. The loss is the project's one GRPO
(engines/grpo.py), the same as the reference trainer's.

Memory between phases (memory.py says how): `offload` moves the optimiser state and gradients
to the host, `offload_params` after SYNC the parameter shards too (and the reference model's);
`onload` brings all back bit for bit. The weights go out gathered one parameter at a time
(gather.py), never the whole model at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import cast

import msgspec
import structlog
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from timeshare.engines.base import RolloutSample
from timeshare.engines.fsdp import checkpoint
from timeshare.engines.fsdp.gather import gathered_parameters, lent_parameters
from timeshare.engines.fsdp.spec import FsdpSpec
from timeshare.engines.grpo import GrpoBatch, completion_logprobs, figures_kept
from timeshare.engines.handoff import COLLECTIVE_TIMEOUT_S
from timeshare.engines.invariance import enable_strict_gemm, pad_linears, require_cpu
from timeshare.engines.sequences import Sequences, pack, unpadded
from timeshare.engines.sharded_trainer import ShardedTrainer, pick_device, widened
from timeshare.engines.spec import EngineChoice
from timeshare.errors import ConfigError
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights.layout import DTYPES, Weight

log = structlog.get_logger(__name__)


def load_model(model_dir: Path, *, batch_invariant: bool = False) -> torch.nn.Module:
    """The causal LM of a local transformers directory, in float32 (the master weights), in
    host memory: `fully_shard` moves each rank's shards to its device, never the whole model.
    `batch_invariant`: its attention and linear layers in that mode (engines/invariance.py)."""
    # Imported here: transformers is an extra, and only the FSDP trainer's workers need it.
    import transformers  # noqa: PLC0415

    from timeshare.engines.fsdp import invariant_attention  # noqa: PLC0415 - transformers'

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers' logging helpers are unannotated
    attention = {"attn_implementation": invariant_attention.register()} if batch_invariant else {}
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True, **attention
    )
    if batch_invariant:
        pad_linears(pretrained)
    pretrained.config.use_cache = False  # training computes whole sequences: no KV cache
    model: torch.nn.Module = pretrained
    with torch.no_grad():
        for parameter in model.parameters():
            # Weights read from a memory-mapped file are not resizable storage, which the
            # offload frees in place (memory.py): give each its own memory. (Sharding over
            # several ranks copies anyway; one rank keeps the loaded tensors.)
            if not parameter.untyped_storage().resizable():
                parameter.data = parameter.data.clone()
    return model


def shard(model: torch.nn.Module, mesh: DeviceMesh, spec: FsdpSpec) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root (what is left: embeddings, norm, head)."""
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[spec.param_dtype], reduce_dtype=DTYPES[spec.reduce_dtype]
    )
    for layer in decoder_layers(model):
        fully_shard(
            layer, mesh=mesh, mp_policy=policy, reshard_after_forward=spec.reshard_after_forward
        )
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers causal LM (`model.layers` in Llama and Qwen2)."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"{type(model).__name__}: no model.layers to shard (a decoder-only transformers LM "
            "keeps its blocks there)"
        )
    return list(layers)


class FsdpTrainer(ShardedTrainer):
    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: EngineChoice,
        *,
        store: JobStore | None = None,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.spec = spec = engine.settings("fsdp", FsdpSpec)
        super().__init__(
            rank,
            world_size,
            engine,
            device=pick_device(spec.device, "engine.fsdp.device"),
            store=store,
            collective_timeout_s=collective_timeout_s,
        )
        self.model_dir = Path(spec.model_dir)
        self.batch_invariant = engine.batch_invariant
        if self.batch_invariant:
            require_cpu(self.device, "engine.fsdp.device", spec.device)  # (a CPU mode)
            enable_strict_gemm()  # before the first GEMM of this process
        self._optimizer: torch.optim.Optimizer | None = None  # built in `bootstrap`

    # -- lifecycle -----------------------------------------------------------------------------

    def bootstrap(self, directory: Path) -> int:
        self.join_process_group()
        self.build()
        self.load_checkpoint(directory)
        self.offload()  # the optimiser waits on the host until TRAIN
        return self.step

    def join_process_group(self) -> None:
        if dist.is_initialized():
            return
        assert self.store is not None, "the FSDP trainer needs the job store"
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            store=self.store.prefixed("fsdp/trainers/"),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.collective_timeout_s),
        )

    def build(self) -> None:
        """Load and shard the model (and the reference model when the loss has a KL term)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        model = load_model(self.model_dir, batch_invariant=self.batch_invariant)
        self._model = shard(model, mesh, self.spec)
        self._optimizer = torch.optim.AdamW(
            self.module.parameters(),
            lr=self.grpo.lr,
            weight_decay=self.grpo.weight_decay,
            betas=(0.9, 0.99),
        )
        if self.grpo.kl_coef > 0:
            reference = load_model(self.model_dir, batch_invariant=self.batch_invariant)
            reference.requires_grad_(False)
            self._reference = shard(reference, mesh, self.spec)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def module(self) -> torch.nn.Module:
        assert self._model is not None, "bootstrap first"
        return self._model

    @property
    def fsdp(self) -> FSDPModule:
        """The model as FSDP sees it (`fully_shard` made its class an `FSDPModule` too)."""
        return cast(FSDPModule, self.module)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self._optimizer is not None, "bootstrap first"
        return self._optimizer

    # -- memory (sharded_trainer.py moves it) -------------------------------------------------

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        tensors = [p.grad for p in self.module.parameters() if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    # -- weights -------------------------------------------------------------------------------

    def iter_weights(self) -> Iterator[tuple[str, Weight]]:
        """Every weight under its transformers name, in the rollout's dtype, one at a time:
        as a gather into the channel's staging, or gathered here (`sync_gather`)."""
        self.param_store.bring_back()  # (after an offload_params: SYNC normally comes before)
        weights = (
            lent_parameters if self.spec.sync_gather == "into_staging" else gathered_parameters
        )
        yield from weights(
            self.module, dtype=DTYPES[self.spec.param_dtype], timeout_s=self.collective_timeout_s
        )

    # -- training ------------------------------------------------------------------------------

    def logprobs(self, batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        self.param_store.bring_back()
        sequences = pack(batch)
        return unpadded(self._logprobs_without_grad(self.module, sequences), sequences)

    def policy_logprobs(self, sequences: Sequences) -> torch.Tensor:
        return self._logprobs_without_grad(self.module, sequences)

    def reference_logprobs(self, sequences: Sequences) -> torch.Tensor | None:
        if self._reference is None:
            return None
        return self._logprobs_without_grad(self._reference, sequences)

    def update(self, data: GrpoBatch, rows: range) -> tuple[float, dict[str, float]]:
        loss, metrics = self.accumulate_gradients(data, rows)
        return loss, metrics | self.apply_gradients()

    def accumulate_gradients(self, data: GrpoBatch, rows: range) -> tuple[float, dict[str, float]]:
        """The gradients of the minibatch `rows`, micro-batch by micro-batch; its loss. Each
        micro-batch's loss is its share of the minibatch's (the token weights say it), so the
        shares add up: no scaling by the micro-batch's size."""
        micro = self.spec.micro_batch_size or len(rows)
        width = data.sequences.widths[1]
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        metrics: dict[str, float] = {}
        for first in range(rows.start, rows.stop, micro):
            piece = slice(first, min(first + micro, rows.stop))
            # Gradients are reduced across ranks once, with the minibatch's last micro-batch.
            self.fsdp.set_requires_gradient_sync(piece.stop >= rows.stop)
            new = self._logprobs(self.module, data.sequences.select(piece))
            loss, metrics = self.loss(widened(new, width), data, piece)
            torch.autograd.backward(loss)
            loss_sum += float(loss.detach())
        return loss_sum, metrics

    def apply_gradients(self) -> dict[str, float]:
        """Clip (over every rank's shards), one AdamW step, gradients dropped."""
        metrics = {}
        if self.spec.max_grad_norm > 0:
            metrics["grad_norm"] = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _clip_gradients(self) -> float:
        """Clip to max_grad_norm over the whole model (every rank's shards); the norm before."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.spec.max_grad_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _logprobs_without_grad(self, model: torch.nn.Module, sequences: Sequences) -> torch.Tensor:
        """Logprobs of a whole batch, micro-batch by micro-batch (the memory a forward takes is
        bounded by `micro_batch_size`, as in training; each trimmed to its own widths), every
        gathered parameter freed after."""
        micro = self.spec.micro_batch_size or sequences.rows
        width = sequences.widths[1]
        with torch.no_grad():
            parts = [
                widened(self._logprobs(model, sequences.select(slice(i, i + micro))), width)
                for i in range(0, sequences.rows, micro)
            ]
        # FSDP2 keeps the root's parameters gathered after a forward (a backward would free
        # them); with no backward coming, free them now.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return torch.cat(parts)

    def _logprobs(self, model: torch.nn.Module, sequences: Sequences) -> torch.Tensor:
        """[rows, completion_width]: the completions' logprobs (sequences.py's layout). No
        attention mask: the rows are right-padded, and in causal attention no real token sees
        a pad; the position ids transformers defaults to (0, 1, ...) are each token's own."""
        tokens = sequences.tokens[:, :-1].to(self.device)
        logits = model(input_ids=tokens).logits
        return completion_logprobs(logits, sequences, self.task.temperature)

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path) -> None:
        """This step, sharded, into the job's checkpoint directory (`directory` is this rank's
        directory in it; the FSDP checkpoint is one for all ranks, in its parent)."""
        own = {
            "step": self.step,
            "rng": torch.get_rng_state(),
            "data_position": self.step,  # prompts are a function of (seed, rank, step)
            "train": None if self.last_train is None else msgspec.to_builtins(self.last_train),
        }
        with self.onloaded():
            checkpoint.save(
                directory.parent,
                self.step,
                self.module,
                self.optimizer,
                own,
                rank=self.rank,
                ranks=self.world_size,
                model_dir=self.model_dir,
                keep=self.keep_checkpoints,
            )

    def load_checkpoint(self, directory: Path) -> None:
        """The newest step every rank holds durably, or the model directory's weights at 0."""
        root = directory.parent
        step = self.agreed_step(directory, checkpoint.committed_step(root))
        if step is None:
            return
        written = checkpoint.check_ranks(
            checkpoint.step_dir(root, step),
            self.world_size,
            fewer_allowed=self.resume_on_fewer_ranks,
        )
        if written != self.world_size and self.rank == 0:
            log.warning(
                "trainer.checkpoint.resharded",
                step=step,
                written_by_ranks=written,
                ranks=self.world_size,
                directory=str(checkpoint.step_dir(root, step)),
            )
        own = checkpoint.load(root, step, self.module, self.optimizer, rank=self.rank)
        torch.set_rng_state(own["rng"])
        self.step = int(own["step"])
        self.last_train = figures_kept(own.get("train"))
        log.info("trainer.checkpoint.loaded", rank=self.rank, step=self.step)


build = FsdpTrainer.from_context  # the registry's builder (registry.py)
