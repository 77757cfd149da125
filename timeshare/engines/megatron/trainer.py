"""The Megatron-core trainer: GRPO with AdamW on a megatron `GPTModel`, tensor-parallel.

The job's trainer ranks form tensor-parallel groups of `tensor_parallel_size` consecutive ranks
(parallel.py). Each rank's rollout samples its own prompts, and the ranks of a TP group must
compute on the same rows: so a TP group trains on the batches of all its ranks at once (their
rows all-gathered, each rank's minibatch m beside the others', `TpRows`), and the data-parallel
replicas average their gradients. TP=2 over two ranks and TP=1 over the same two ranks (two
data-parallel replicas) then take the same optimiser steps on the same rows (with the
token-mean loss, when the ranks' minibatches hold as many tokens: a replica's minibatch loss is
the mean over its own tokens, as every trainer's). Samples differ in length: before the gather
each rank pads its batch to the widths of the group's widest.

Logprobs come from megatron's forward with the logits left split over the vocabulary
(`parallel_output`), through the vocab-parallel cross entropy: no rank ever holds a whole row of
logits. The loss is the project's one GRPO (engines/grpo.py), as every trainer's; the loss
reported is the job's (the mean over the data-parallel replicas).

On a CPU the optimiser is torch's AdamW over the local shards, the gradients all-reduced over
the data-parallel group and clipped over the whole model; on CUDA megatron's DDP and distributed
optimizer (optimizers.py). Memory between phases is `host_memory.HostStore`'s, as FSDP's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import structlog
import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from timeshare.engines.base import RolloutSample
from timeshare.engines.grpo import (
    GrpoBatch,
    figures_kept,
    rewards_of,
    sampled_logprobs,
    scored_rows,
)
from timeshare.engines.handoff import COLLECTIVE_TIMEOUT_S
from timeshare.engines.invariance import MIN_GEMM_ROWS, enable_strict_gemm, require_cpu
from timeshare.engines.megatron import checkpoint, parallel
from timeshare.engines.megatron.gather import lent_weights
from timeshare.engines.megatron.hf_config import HfShape
from timeshare.engines.megatron.model import build_model, load_hf, read_hf
from timeshare.engines.megatron.optimizers import DistributedAdam, HostAdamW, Optimizing
from timeshare.engines.megatron.parallel import Layout
from timeshare.engines.megatron.spec import MegatronSpec
from timeshare.engines.megatron.tp_rows import TpRows
from timeshare.engines.sequences import PAD, Sequences, completion_logits, pack, unpadded
from timeshare.engines.sharded_trainer import ShardedTrainer, pick_device, widened
from timeshare.engines.spec import EngineChoice
from timeshare.errors import ConfigError
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights.layout import DTYPES, Weight
from timeshare.task.grpo_math import group_advantages, token_logprobs

log = structlog.get_logger(__name__)


def tensors_of(sequences: Sequences) -> list[torch.Tensor]:
    """A batch's tensors as the TP group's gathers move them (the mask as bytes: gloo gathers
    no bools)."""
    tokens, prompt_lengths, completions, mask = sequences
    return [tokens, prompt_lengths, completions, mask.to(torch.uint8)]


def sequences_of(tensors: list[torch.Tensor]) -> Sequences:
    """The batch whose tensors (`tensors_of`'s) are `tensors`."""
    tokens, prompt_lengths, completions, mask = tensors
    return Sequences(tokens, prompt_lengths, completions, mask.bool())


class MegatronTrainer(ShardedTrainer):
    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: EngineChoice,
        *,
        store: JobStore | None = None,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.spec = spec = engine.settings("megatron", MegatronSpec)
        spec.check_ranks(world_size)
        super().__init__(
            rank,
            world_size,
            engine,
            device=pick_device(spec.device, "engine.megatron.device"),
            store=store,
            collective_timeout_s=collective_timeout_s,
        )
        self.layout = Layout(rank=rank, world=world_size, tp=spec.tensor_parallel_size)
        self.model_dir = Path(spec.model_dir)
        self.batch_invariant = engine.batch_invariant
        if self.batch_invariant:
            require_cpu(self.device, "engine.megatron.device", spec.device)  # (a CPU mode)
            enable_strict_gemm()  # before the first GEMM of this process
        self.shape = HfShape.read(self.model_dir)
        self._model: GPTModel | None = None
        self._reference: GPTModel | None = None
        self._optimizing: Optimizing | None = None
        self._rows: TpRows | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def bootstrap(self, directory: Path) -> int:
        self.parallel_join()
        self.build()
        self.load_checkpoint(directory)
        self.offload()  # the optimiser waits on the host until TRAIN
        return self.step

    def parallel_join(self) -> None:
        """This process into the trainers' world and megatron's groups (parallel.py)."""
        if self.device.type == "cuda":  # before any CUDA call: megatron's seeding makes one
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        parallel.join(
            self.layout, self.device, self.store, self.collective_timeout_s, self.spec.seed
        )

    def build(self) -> None:
        """This rank's shards of the model (and of the reference model for a KL term), loaded
        from the model directory's HF weights."""
        problem = self.shape.split_problem(self.layout.tp)
        if problem:
            raise ConfigError(problem)
        hf = read_hf(self.model_dir)
        self._model = self._loaded(hf)
        if self.device.type == "cuda":
            self._optimizing = DistributedAdam(self.model, self.grpo, self.spec.max_grad_norm)
        else:
            self._optimizing = HostAdamW(
                self.model, self.layout, self.grpo, self.spec.max_grad_norm
            )
        if self.grpo.kl_coef > 0:
            self._reference = self._loaded(hf).requires_grad_(False)
        self._rows = TpRows(self.layout, self.grpo.minibatches)

    def _loaded(self, hf: dict[str, torch.Tensor]) -> GPTModel:
        model = build_model(
            self.shape, self.layout.tp, self.device, batch_invariant=self.batch_invariant
        )
        load_hf(model, hf, self.shape, self.layout.tp, self.layout.tp_rank)
        return model

    def close(self) -> None:
        parallel.leave()

    @property
    def model(self) -> GPTModel:
        assert self._model is not None, "bootstrap first"
        return self._model

    @property
    def optimizing(self) -> Optimizing:
        assert self._optimizing is not None, "bootstrap first"
        return self._optimizing

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """torch's AdamW of a CPU trainer (the tests read its state by parameter)."""
        assert isinstance(self.optimizing, HostAdamW), "a CPU trainer's"
        return self.optimizing.optimizer

    @property
    def rows(self) -> TpRows:
        assert self._rows is not None, "bootstrap first"
        return self._rows

    # -- memory (sharded_trainer.py moves it) -------------------------------------------------

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return self.optimizing.tensors()

    # -- weights -------------------------------------------------------------------------------

    def iter_weights(self) -> Iterator[tuple[str, Weight]]:
        """Every HF tensor under its HF name, in the rollout's dtype, one at a time, each
        gathered over the TP group into the channel's staging (gather.py)."""
        self.param_store.bring_back()
        yield from lent_weights(
            dict(self.model.named_parameters()),
            self.shape.params(),
            self.shape.geometry(self.layout.tp),
            group=self.layout.tp_group,
            dtype=DTYPES[self.spec.param_dtype],
            timeout_s=self.collective_timeout_s,
        )

    # -- training ------------------------------------------------------------------------------

    def logprobs(self, batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        """This rank's samples' logprobs; a collective over the TP group (its ranks compute
        on the rows of all of them, each rank's batch padded to the group's widths)."""
        self.param_store.bring_back()
        own = pack(batch)
        padded = self.rows.padded(own.to(self.device), self.device)
        together = sequences_of(self.rows.gather_plain(tensors_of(padded)))
        values = self._logprobs_without_grad(self.model, together)
        return unpadded(self.rows.own_plain(values), own)

    def prepare(self, batch: list[RolloutSample]) -> GrpoBatch:
        """The TP group's rows (every rank's batch, padded to the group's widths, minibatch by
        minibatch), with the logprobs, advantages and token weights all its minibatches use.
        Advantages are computed on each rank's own batch first: a group of samples never spans
        two ranks."""
        own = pack(batch)
        rewards = rewards_of(batch)
        scored = scored_rows(batch)
        advantages = group_advantages(rewards, self.task.group_size, scored)
        # (collectives move device tensors: NCCL's on CUDA)
        padded = self.rows.padded(own.to(self.device), self.device)
        sampled = widened(sampled_logprobs(batch, own), padded.widths[1])
        per_row = [t.to(self.device) for t in (sampled, rewards, advantages, scored.float())]
        gathered = self.rows.gather([*tensors_of(padded), *per_row])
        sequences = sequences_of(gathered[:4])
        sampled, rewards, advantages, counted = gathered[4:]
        sampled, rewards = sampled.cpu(), rewards.cpu()  # the step's figures are read there
        scored = counted.cpu() > 0.5
        old = self.policy_logprobs(sequences)
        ref = self.reference_logprobs(sequences)
        # A minibatch is one optimiser step of the group: its rows are every rank's rows of
        # that minibatch (consecutive, minibatch-major), and its loss is their weighted sum.
        chunk = self.rows.minibatch_rows(len(batch))
        # a skipped sample's tokens weigh nothing (they stay in the logprob check)
        trained = sequences.mask & scored.to(sequences.mask.device).unsqueeze(1)
        weights = self.token_weights(trained, chunk)
        return GrpoBatch(sequences, sampled, rewards, old, advantages, ref, weights, scored)

    def policy_logprobs(self, sequences: Sequences) -> torch.Tensor:
        return self._logprobs_without_grad(self.model, sequences)

    def reference_logprobs(self, sequences: Sequences) -> torch.Tensor | None:
        if self._reference is None:
            return None
        return self._logprobs_without_grad(self._reference, sequences)

    def update(self, data: GrpoBatch, rows: range) -> tuple[float, dict[str, float]]:
        """One optimiser step on the TP group's minibatch that holds this rank's `rows`. Each
        micro-batch's loss is its share of the minibatch's (the token weights say it): the
        shares add up, no scaling."""
        group_rows = self.rows.minibatch(rows)
        micro = self.spec.micro_batch_size or len(group_rows)
        width = data.sequences.widths[1]
        self.optimizing.zero_grad()
        loss_sum = 0.0
        metrics: dict[str, float] = {}
        for first in range(group_rows.start, group_rows.stop, micro):
            piece = slice(first, min(first + micro, group_rows.stop))
            new = self._logprobs(self.optimizing.module, data.sequences.select(piece))
            loss, metrics = self.loss(widened(new, width), data, piece)
            torch.autograd.backward(loss)
            loss_sum += float(loss.detach())
        metrics |= self.optimizing.step()
        return self._job_mean(loss_sum), metrics

    def _job_mean(self, value: float) -> float:
        """`value` averaged over the data-parallel replicas (the job's, not this group's)."""
        if self.layout.dp == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.layout.dp_group)
        return float(total) / self.layout.dp

    def _logprobs_without_grad(self, model: GPTModel, sequences: Sequences) -> torch.Tensor:
        """Logprobs of a whole batch, micro-batch by micro-batch (each trimmed to its own
        widths: the same on every rank of the group, whose rows are the same)."""
        micro = self.spec.micro_batch_size or sequences.rows
        width = sequences.widths[1]
        with torch.no_grad():
            parts = [
                widened(self._logprobs(model, sequences.select(slice(i, i + micro))), width)
                for i in range(0, sequences.rows, micro)
            ]
        return torch.cat(parts)

    def _logprobs(self, model: torch.nn.Module, sequences: Sequences) -> torch.Tensor:
        """[rows, completion_width]: the completions' logprobs (sequences.py's layout) at the
        task's temperature. No attention mask (right padding, causal attention) and positions
        0, 1, ...: each token's own. The logits stay split over the vocabulary; the
        vocab-parallel cross entropy reduces over it."""
        tokens = self._model_input(sequences)
        positions = torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
        logits = completion_logits(model(tokens, positions, None), sequences)
        completions = sequences.completions.to(self.device)
        if self.batch_invariant:  # (one TP rank: its logits are whole) as the rollout does it
            return token_logprobs(logits, completions, self.task.temperature)
        scaled = logits.float() / self.task.temperature
        losses: torch.Tensor = tensor_parallel.vocab_parallel_cross_entropy(
            scaled.contiguous(), completions
        )
        return -losses

    def _model_input(self, sequences: Sequences) -> torch.Tensor:
        """The tokens the model reads, `tokens[:, :-1]`. In the batch-invariant mode at least
        MIN_GEMM_ROWS of them: megatron's linear layers are its own, unpadded, and a GEMM of
        fewer rows (a short sequence alone) rounds them another way; PAD columns on the right
        add rows that no real token sees (causal attention)."""
        tokens = sequences.tokens[:, :-1].to(self.device)
        if self.batch_invariant:
            short = -(-MIN_GEMM_ROWS // tokens.shape[0]) - tokens.shape[1]
            if short > 0:
                tokens = torch.nn.functional.pad(tokens, (0, short), value=PAD)
        return tokens

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path) -> None:
        """This step, sharded, into the job's checkpoint directory (`directory` is this rank's
        directory in it; the Megatron checkpoint is one for all ranks, in its parent)."""
        own = {
            "step": self.step,
            "rng": torch.get_rng_state(),
            "train": None if self.last_train is None else msgspec.to_builtins(self.last_train),
        }
        with self.onloaded():
            optimizer = self.optimizing.shared_state()  # (every rank: it may gather)
            shards = None
            if self.layout.dp_rank == 0:  # the replicas hold the same shards: one writes them
                shards = {
                    "model": {n: p.detach() for n, p in self.model.named_parameters()},
                    "optimizer": optimizer,
                }
            checkpoint.save(
                directory.parent,
                self.step,
                self.layout,
                own,
                shards,
                model_dir=self.model_dir,
                keep=self.keep_checkpoints,
            )

    def load_checkpoint(self, directory: Path) -> None:
        """The newest step every rank holds durably, or the model directory's weights at 0."""
        step = self.agreed_step(directory, checkpoint.committed_step(directory.parent))
        if step is None:
            return
        shards, own = checkpoint.load(
            directory.parent, step, self.layout, same_ranks=self.device.type == "cuda"
        )
        own_params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in shards["model"].items():
                own_params[name].copy_(tensor)
        self.optimizing.load(shards["optimizer"])
        if own is not None:
            torch.set_rng_state(own["rng"])
        self.step = step
        self.last_train = figures_kept(None if own is None else own.get("train"))
        log.info("trainer.checkpoint.loaded", rank=self.rank, step=self.step)


build = MegatronTrainer.from_context  # the registry's builder (registry.py)
