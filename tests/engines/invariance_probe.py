"""One case of the batch-invariance switch, in a process of its own (the switch changes MKL for
the whole process, once): `python -m tests.engines.invariance_probe on|off|late TRAINER`
(torch_ref, fsdp or megatron).

It builds the trainer (torch_ref, or FSDP over a transformers directory of the same model) and
the reference rollout through the registry, as a worker does, with `[engine] batch_invariant`
on or off; says what the switch installed (MKL's setting in the environment and the mode MKL
says it runs, which of the models' linear layers and attentions run the mode) and what the
process and a process it starts (as vLLM's engine is started) see of the switches it may have
inherited; samples a batch, and compares the logprobs the rollout sampled with the trainer's and
with the rollout's own re-scoring of a sequence alone and beside other neighbours; runs the
drift probe (drift.py) on the batch, and again once a weight of the rollout is perturbed; then
the trainer's logprobs of rows of differing lengths (right-padded) as one batch and each alone,
and the rollout's of them. Its last line on stdout is a JSON object.

`late`: MKL computes a GEMM first, then the trainer is built with the switch on; the object
says what the build raised.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from timeshare.engines.base import RolloutSample, TrainerEngine
from timeshare.engines.context import EngineContext
from timeshare.engines.drift import drift
from timeshare.engines.fsdp.trainer import FsdpTrainer
from timeshare.engines.invariance import (
    CBWR_ENV,
    SWITCH_VARIABLES,
    PaddedLinear,
    gemm_is_row_invariant,
    mkl_cbwr_mode,
)
from timeshare.engines.megatron.cpu import RowLocalAttention, SdpaAttention
from timeshare.engines.megatron.trainer import MegatronTrainer
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.pairs import build_rollout, build_trainer
from timeshare.engines.spec import engine_spec
from timeshare.engines.task import TaskWorkload
from timeshare.engines.torch_ref.model import Attention, CausalLM
from timeshare.engines.torch_ref.rollout import TorchRefRollout
from timeshare.engines.torch_ref.trainer import TorchRefTrainer
from timeshare.errors import TimeshareError
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights.layout import Weight
from timeshare.task.vocab import BOS, DIGITS, EOS, PROMPT_DIGITS, SEP

COMPLETION = 5  # the longest completion
TASK = {
    "prompts_per_rank": 2,
    "group_size": 4,
    "max_completion_tokens": COMPLETION,
    "temperature": 1.0,
}
MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
PROBED = 4  # sequences the drift probe re-scores ([checks] invariance_samples' default)
PERTURBATION = 1e-3  # the relative change of the rollout's lm_head.weight
SHAPE = ModelShape(hidden=64, intermediate=128, heads=4, kv_heads=4)  # MODEL, as a directory


def flagged(model: torch.nn.Module | None) -> list[int]:
    """[modules in the batch-invariant mode, linear layers and attentions in all]."""
    assert model is not None
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    padded = [m for m in linears if isinstance(m, PaddedLinear) or vars(m).get("batch_invariant")]
    if isinstance(model, CausalLM):
        own = [m for m in model.modules() if isinstance(m, Attention)]
        attentions, rowlocal = len(own), sum(m.batch_invariant for m in own)
    elif isinstance(model, GPTModel):  # megatron's: its linear layers are its own, unpadded
        cores = [m for m in model.modules() if isinstance(m, SdpaAttention)]
        attentions, rowlocal = len(cores), sum(isinstance(m, RowLocalAttention) for m in cores)
    else:  # a transformers model: one attention implementation for every layer
        layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        chosen = getattr(model.config, "_attn_implementation", None)
        attentions, rowlocal = len(layers), len(layers) if chosen == "timeshare_row_local" else 0
    return [len(padded) + rowlocal, len(linears) + attentions]


def largest_difference(a: list[tuple[float, ...]], b: list[tuple[float, ...]]) -> float:
    pairs = (zip(x, y, strict=True) for x, y in zip(a, b, strict=True))
    return max(abs(one - other) for row in pairs for one, other in row)


def context_of(on: bool, trainer_kind: str, scratch: Path) -> EngineContext:
    sections: dict[str, Any] = {"torch_ref": {"kv_cache_len": 16}}
    if trainer_kind in ("fsdp", "megatron"):  # the same model, from a transformers directory
        model_dir = str(init_model_dir(scratch / "model", SHAPE, seed=0))
        # on the CPU, where a GPU is too: the project's mode is a CPU mode
        sections[trainer_kind] = {"model_dir": model_dir, "device": "cpu"}
    else:
        sections["torch_ref"]["model"] = MODEL
    spec = engine_spec(
        trainer=trainer_kind,
        rollout="torch_ref",
        batch_invariant=on,
        task=TASK,
        grpo={"kl_coef": 0.02},  # (a reference model too)
        **sections,
    )
    return EngineContext(spec=spec, rank=0, world_size=1, store=JobStore.host())


def late(trainer_kind: str, scratch: Path) -> dict[str, Any]:
    """The trainer built with the switch on after MKL computed a GEMM in this process: what it
    raised ("": nothing)."""
    torch.nn.functional.linear(torch.ones(8, 8), torch.ones(8, 8))  # MKL's first GEMM
    context = context_of(True, trainer_kind, scratch)
    try:
        build_trainer(context)
    except TimeshareError as exc:
        return {"refused": str(exc)}
    return {"refused": ""}


def switches_seen() -> dict[str, Any]:
    """The batch-invariance switches in this process's environment, and in that of a process
    it starts now (as an engine starts its own: vLLM's)."""
    shows = "import json, os; print(json.dumps(dict(os.environ)))"
    child = subprocess.run([sys.executable, "-c", shows], capture_output=True, check=True)
    inherited = json.loads(child.stdout)
    return {
        "here": {name: os.environ.get(name) for name in SWITCH_VARIABLES},
        "child": {name: inherited.get(name) for name in SWITCH_VARIABLES},
    }


def probe(on: bool, trainer_kind: str, scratch: Path) -> dict[str, Any]:
    context = context_of(on, trainer_kind, scratch)
    spec = context.spec
    trainer = build_trainer(context)
    trainer.bootstrap(scratch / "checkpoints")
    trainer.onload()
    rollout = build_rollout(context)
    assert isinstance(rollout, TorchRefRollout)
    rollout.begin_weight_update()
    rollout.wake({"weights"})
    rollout.load_weights([(name, whole(weight)) for name, weight in trainer.iter_weights()])
    rollout.finish_weight_update(trainer.step)
    rollout.mark_whole(trainer.step)
    rollout.wake({"kv_cache"})
    samples = rollout.generate(TaskWorkload(spec.task).requests(0, 0))
    sampled = [s.logprobs for s in samples]

    def rescored(batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        return rollout.score(batch, spec.task.temperature)

    alone = [rescored([samples[i]])[0] for i in range(len(samples))]
    beside = rescored([samples[7], samples[3], samples[0]])  # other neighbours, another size
    uneven = uneven_batch(samples)
    uneven_together = trainer.logprobs(uneven)
    uneven_alone = [trainer.logprobs([sample])[0] for sample in uneven]
    result: dict[str, Any] = {
        "cbwr": os.environ.get(CBWR_ENV),
        "mkl_cbwr": mkl_cbwr_mode(),
        "switches": switches_seen(),
        "gemm_row_invariant": gemm_is_row_invariant(),
        "flagged": {
            "trainer": flagged(models(trainer)[0]),
            "reference": flagged(models(trainer)[1]),
            "rollout": flagged(rollout.model),
        },
        "trainer_vs_rollout": largest_difference(trainer.logprobs(samples), sampled),
        "alone_vs_batch": largest_difference(alone, sampled),
        "beside_vs_batch": largest_difference(beside, [sampled[7], sampled[3], sampled[0]]),
        # The trainer on rows of differing lengths, right-padded: as one batch, each row alone
        # (a batch of 1), and the rollout's re-scoring of them as one batch.
        "uneven_lengths": sorted({(len(s.prompt_tokens), len(s.tokens)) for s in uneven}),
        "trainer_uneven_alone_vs_batch": largest_difference(uneven_alone, uneven_together),
        "trainer_vs_rollout_uneven": largest_difference(uneven_together, rescored(uneven)),
        # the drift probe on this batch, as the worker runs it (RolloutWorker.drift)
        "drift": drift(samples, rescored, PROBED),
    }
    # and once a weight of the rollout moved since it sampled the batch (what a rollout whose
    # numbers changed under the batch would show); last: nothing after it uses the model
    assert rollout.model is not None
    with torch.no_grad():
        rollout.model.lm_head.weight.mul_(1 + PERTURBATION)
    result["drift_perturbed"] = drift(samples, rescored, PROBED)
    return result


def uneven_batch(samples: list[RolloutSample]) -> list[RolloutSample]:
    """The samples' completions cut to 1 to TASK's max_completion_tokens tokens (the even
    lengths stopped at EOS), after prompts of 3, 4 and 5 tokens: rows of every length, the
    shortest (3 + 1 tokens) fewer than a GEMM's MIN_GEMM_ROWS when alone."""
    uneven = []
    for index, sample in enumerate(samples):
        length = 1 + (index * 3) % COMPLETION
        # (a completion that stopped early at EOS is made as long with its first token)
        tokens = list(sample.tokens[:length]) + [sample.tokens[0]] * (length - len(sample.tokens))
        if length % 2 == 0:
            tokens[-1] = EOS
        prompt = (BOS, *[index % DIGITS] * (1 + index % PROMPT_DIGITS), SEP)
        uneven.append(
            dataclasses.replace(
                sample, prompt_tokens=prompt, tokens=tuple(tokens), logprobs=(0.0,) * length
            )
        )
    return uneven


def whole(weight: Weight) -> torch.Tensor:
    """A weight as a tensor (FSDP's gathers write themselves into a buffer)."""
    if isinstance(weight, torch.Tensor):
        return weight
    buffer = torch.empty(weight.scratch_bytes, dtype=torch.uint8)
    weight.write_into(buffer)
    return buffer[: weight.nbytes].view(weight.dtype).view(weight.shape)


def models(trainer: TrainerEngine) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The trainer's model and its reference model."""
    if isinstance(trainer, TorchRefTrainer):
        return trainer.model, trainer.reference
    if isinstance(trainer, MegatronTrainer):
        return trainer.model, trainer._reference
    assert isinstance(trainer, FsdpTrainer)
    return trainer.module, trainer._reference


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="ts-inv-") as directory:
        if sys.argv[1] == "late":
            print(json.dumps(late(sys.argv[2], Path(directory))))
        else:
            print(json.dumps(probe(sys.argv[1] == "on", sys.argv[2], Path(directory))))
