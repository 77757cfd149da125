"""Per-request sampling seeds in SGLang on every attention backend.

SGLang samples a request with its own seed (`sampling_seed`, a counter-based hash of seed and
position: batch-independent) only under `enable_deterministic_inference`, which it allows for
a few GPU attention backends and not for `torch_native`, the CPU engine's. Without it, every
request draws from the scheduler's global RNG and a seed means nothing: the contract's
"the same seed gives the same tokens" fails silently. `SEEDED_SAMPLING` gives each batch the
seeds of its requests whatever the mode; the sampler then uses SGLang's own seeded path. It is
applied in SGLang's scheduler (boot.py) where the engine runs without deterministic mode
(engine.py sets that mode itself where SGLang allows it).
"""

from __future__ import annotations

from typing import Any

import torch

from timeshare.engines.patches import Patch

TARGET = "sglang.srt.sampling.sampling_batch_info:SamplingBatchInfo.from_schedule_batch"
UNSEEDED = 0  # what a request without a seed gets (engine.py always sends one)


def seed_every_batch() -> None:
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: PLC0415

    original = SamplingBatchInfo.from_schedule_batch.__func__

    def from_schedule_batch(cls: type, batch: Any, vocab_size: int) -> Any:
        info = original(cls, batch, vocab_size)
        if info.sampling_seed is None:
            seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
            info.sampling_seed = torch.tensor(
                [UNSEEDED if seed is None else seed for seed in seeds],
                dtype=torch.int64,
                device=info.temperatures.device,
            )
        return info

    SamplingBatchInfo.from_schedule_batch = classmethod(from_schedule_batch)


SEEDED_SAMPLING = Patch(
    name="sglang.seeded_sampling",
    source_of=TARGET,
    known=frozenset({"eb40990272120f65"}),  # sglang 0.5.23
    apply=seed_every_batch,
    why="SGLang honours per-request seeds only in deterministic mode, which torch_native lacks",
)
