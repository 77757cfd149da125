"""One case of the batch-invariance switch, in a process of its own (the switch changes MKL for
the whole process, once): `python -m tests.engines.torch_ref.invariance_probe on|off`.

It builds the reference trainer and rollout through the registry, as a worker does, with
`[engine] batch_invariant` on or off; says what the switch installed (MKL's setting, which of
the models' linear layers and attentions run the mode); samples a batch, and compares the
logprobs the rollout sampled with the trainer's and with the rollout's own re-scoring of a
sequence alone and beside other neighbours. Its last line on stdout is a JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from timeshare.engines.base import RolloutSample
from timeshare.engines.context import EngineContext
from timeshare.engines.invariance import CBWR_ENV, gemm_is_row_invariant
from timeshare.engines.pairs import build_rollout, build_trainer
from timeshare.engines.spec import engine_spec
from timeshare.engines.task import TaskWorkload
from timeshare.engines.torch_ref.model import Attention, CausalLM, Linear
from timeshare.engines.torch_ref.rollout import TorchRefRollout
from timeshare.engines.torch_ref.trainer import TorchRefTrainer
from timeshare.protocols.store import JobStore

TASK = {"prompts_per_rank": 2, "group_size": 4, "completion_tokens": 5, "temperature": 1.0}
MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}


def flagged(model: CausalLM | None) -> list[int]:
    """[modules in the batch-invariant mode, linear layers and attentions in all]."""
    assert model is not None
    modules = [m for m in model.modules() if isinstance(m, Linear | Attention)]
    return [sum(m.batch_invariant for m in modules), len(modules)]


def largest_difference(a: list[tuple[float, ...]], b: list[tuple[float, ...]]) -> float:
    pairs = (zip(x, y, strict=True) for x, y in zip(a, b, strict=True))
    return max(abs(one - other) for row in pairs for one, other in row)


def probe(on: bool) -> dict[str, Any]:
    spec = engine_spec(
        trainer="torch_ref",
        rollout="torch_ref",
        batch_invariant=on,
        task=TASK,
        grpo={"kl_coef": 0.02},  # (a reference model too)
        torch_ref={"kv_cache_len": 16, "model": MODEL},
    )
    store = JobStore.host()
    context = EngineContext(spec=spec, rank=0, world_size=1, store=store)
    trainer = build_trainer(context)
    rollout = build_rollout(context)
    assert isinstance(trainer, TorchRefTrainer) and isinstance(rollout, TorchRefRollout)
    rollout.begin_weight_update()
    rollout.wake({"weights"})
    rollout.load_weights(list(trainer.iter_weights()))
    rollout.finish_weight_update(trainer.step)
    rollout.mark_whole(trainer.step)
    rollout.wake({"kv_cache"})
    samples = rollout.generate(TaskWorkload(spec.task).requests(0, 0))
    sampled = [s.logprobs for s in samples]

    def rescored(batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        return rollout.score(batch, spec.task.temperature)

    alone = [rescored([samples[i]])[0] for i in range(len(samples))]
    beside = rescored([samples[7], samples[3], samples[0]])  # other neighbours, another size
    return {
        "cbwr": os.environ.get(CBWR_ENV),
        "gemm_row_invariant": gemm_is_row_invariant(),
        "flagged": {
            "trainer": flagged(trainer.model),
            "reference": flagged(trainer.reference),
            "rollout": flagged(rollout.model),
        },
        "trainer_vs_rollout": largest_difference(trainer.logprobs(samples), sampled),
        "alone_vs_batch": largest_difference(alone, sampled),
        "beside_vs_batch": largest_difference(beside, [sampled[7], sampled[3], sampled[0]]),
    }


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1] == "on")))
