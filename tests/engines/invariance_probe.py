"""One case of the batch-invariance switch, in a process of its own (the switch changes MKL for
the whole process, once): `python -m tests.engines.invariance_probe on|off TRAINER` (torch_ref,
fsdp or megatron).

It builds the trainer (torch_ref, or FSDP over a transformers directory of the same model) and
the reference rollout through the registry, as a worker does, with `[engine] batch_invariant`
on or off; says what the switch installed (MKL's setting, which of the models' linear layers
and attentions run the mode); samples a batch, and compares the logprobs the rollout sampled
with the trainer's and with the rollout's own re-scoring of a sequence alone and beside other
neighbours; then the trainer's logprobs of rows of differing lengths (right-padded) as one
batch and each alone, and the rollout's of them. Its last line on stdout is a JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from timeshare.engines.base import RolloutSample, TrainerEngine
from timeshare.engines.context import EngineContext
from timeshare.engines.fsdp.trainer import FsdpTrainer
from timeshare.engines.invariance import CBWR_ENV, PaddedLinear, gemm_is_row_invariant
from timeshare.engines.megatron.cpu import RowLocalAttention, SdpaAttention
from timeshare.engines.megatron.trainer import MegatronTrainer
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.pairs import build_rollout, build_trainer
from timeshare.engines.spec import engine_spec
from timeshare.engines.task import TaskWorkload
from timeshare.engines.torch_ref.model import Attention, CausalLM
from timeshare.engines.torch_ref.rollout import TorchRefRollout
from timeshare.engines.torch_ref.trainer import TorchRefTrainer
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


def probe(on: bool, trainer_kind: str, scratch: Path) -> dict[str, Any]:
    sections: dict[str, Any] = {"torch_ref": {"kv_cache_len": 16}}
    if trainer_kind in ("fsdp", "megatron"):  # the same model, from a transformers directory
        model_dir = str(init_model_dir(scratch / "model", SHAPE, seed=0))
        sections[trainer_kind] = {"model_dir": model_dir}
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
    store = JobStore.host()
    context = EngineContext(spec=spec, rank=0, world_size=1, store=store)
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
    return {
        "cbwr": os.environ.get(CBWR_ENV),
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
    }


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
        print(json.dumps(probe(sys.argv[1] == "on", sys.argv[2], Path(directory))))
