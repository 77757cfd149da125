"""`[engine.fsdp]`: the FSDP2 trainer's own settings (model directory, precision, batching).

Selected with `[engine] trainer = "fsdp"`: the task, the sampling and the GRPO and AdamW
settings are the job's (`[engine.task]`, `[engine.grpo]`), which every trainer reads, so that a
run can switch trainers without restating its RL. No torch here: the job config is read without
it. Whether transformers can load `model_dir` is asked in a child process at load time
(check.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from timeshare.engines.footprint import DTYPE_BYTES, TrainerFootprint
from timeshare.engines.model_config import ModelConfig, TrainedModel
from timeshare.errors import ConfigError

PrecisionName = Literal["float32", "bfloat16", "float16"]
# How SYNC gathers each parameter: its all-gather writes straight into the weight channel's
# staging (the only copy), or into a fresh tensor that the channel then copies in. Into staging,
# a gather waits for a free buffer on every rank: the ranks move in lock-step with the slowest
# rank's loader, where gathering ahead ("then_pack") lets a fast rank run a bucket ahead.
SyncGather = Literal["into_staging", "then_pack"]
DeviceName = Literal["auto", "cpu", "cuda"]


class FsdpSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # A local transformers directory (config.json + *.safetensors); never a hub download.
    model_dir: str = ""
    # "auto": CUDA (NCCL) when this process sees a GPU, else CPU (gloo).
    device: DeviceName = "auto"
    # The mixed-precision policy: parameters are kept in float32 (the optimiser's master copy);
    # forward and backward compute in `param_dtype`, gradients are reduced in `reduce_dtype`.
    # The rollout receives the weights in `param_dtype`. On CPU keep float32.
    param_dtype: PrecisionName = "float32"
    reduce_dtype: PrecisionName = "float32"
    # Samples per forward/backward; the gradients of a minibatch's micro-batches accumulate
    # before its optimiser step. 0: the whole minibatch at once.
    micro_batch_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_grad_norm: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0  # 0: no clipping
    sync_gather: SyncGather = "into_staging"
    # Free each layer's gathered parameters after its forward (memory) or keep them until the
    # backward (one all-gather less per layer).
    reshard_after_forward: bool = True

    def check_named(self) -> None:
        """A `ConfigError` if no model directory is named."""
        if not self.model_dir:
            raise ConfigError(
                'engine.fsdp.model_dir: trainer = "fsdp" trains a transformers model '
                "directory; name one (`timeshare model init DIR` makes a small one)"
            )

    def trainer_footprint(self, ranks: int) -> TrainerFootprint:
        """FSDP2 over a 1-D mesh of every rank: parameters, gradients and AdamW all sharded
        `ranks` ways; each decoder layer gathered whole, in param_dtype, to compute."""
        return TrainerFootprint(
            tensor_parallel=1,
            tp_key="",
            parameter_shards=ranks,
            optimizer_shards=ranks,
            compute_bytes=DTYPE_BYTES[self.param_dtype],
            sync_bytes=DTYPE_BYTES[self.param_dtype],
            gathers_layers=True,
            micro_batch=self.micro_batch_size,
        )

    def trained_model(self) -> TrainedModel:
        """The model directory's model: every rollout engine starts from it."""
        where = f"engine.fsdp.model_dir: {self.model_dir}"
        self.check_named()
        if not Path(self.model_dir).is_dir():
            raise ConfigError(f"{where} is not a directory")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ConfigError(
                f"{where} has no config.json (a transformers model directory holds config.json "
                "and *.safetensors)"
            )
        return TrainedModel(
            config=ModelConfig.from_json(Path(self.model_dir) / "config.json"),
            directory=self.model_dir,
            where=f"engine.fsdp.model_dir {self.model_dir}",
        )
