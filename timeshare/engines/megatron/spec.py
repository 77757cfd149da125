"""`[engine.megatron]`: the Megatron-core trainer's own settings.

Selected with `[engine] trainer = "megatron"`. The job's ranks are split into tensor-parallel
groups of `tensor_parallel_size` consecutive ranks (ranks 0..tp-1 are the first group); the
data-parallel size is what is left, job.ranks / tensor_parallel_size. The task, sampling, GRPO
and AdamW settings are the job's (`[engine.task]`, `[engine.grpo]`), as for every trainer. No
torch here: the job config is read without it; the model directory is read by `trained_model`
(its config.json) and asked of megatron-core in a child process at load time (check.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from timeshare.engines.footprint import DTYPE_BYTES, TrainerFootprint
from timeshare.engines.model_config import ModelConfig, TrainedModel
from timeshare.errors import ConfigError

PrecisionName = Literal["float32", "bfloat16", "float16"]
DeviceName = Literal["auto", "cpu", "cuda"]


class MegatronSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # A local transformers directory (config.json + *.safetensors) to start from: Llama or
    # Qwen2 (names.py holds one table per architecture).
    model_dir: str = ""
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    # "auto": CUDA (NCCL, megatron's DDP and distributed optimizer) when this process sees a
    # GPU, else CPU (gloo, torch's AdamW over an all-reduce of the gradients).
    device: DeviceName = "auto"
    # The dtype the rollout receives (SYNC casts to it). The trainer computes in float32 on
    # every device: megatron's bf16 mixed precision (Float16Module) is not wired in yet.
    param_dtype: PrecisionName = "float32"
    # Samples per forward/backward within a tensor-parallel group's minibatch; 0: the whole
    # minibatch at once.
    micro_batch_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_grad_norm: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0  # 0: no clipping
    seed: int = 0  # megatron's model-parallel RNG (dropout; the model is loaded, not drawn)

    def check_named(self) -> None:
        if not self.model_dir:
            raise ConfigError(
                'engine.megatron.model_dir: trainer = "megatron" trains a transformers model '
                "directory (Llama or Qwen2); name one (`timeshare model init DIR` makes one)"
            )

    def check_ranks(self, ranks: int) -> None:
        """A `ConfigError` unless the job's ranks split into tensor-parallel groups."""
        if ranks % self.tensor_parallel_size:
            raise ConfigError(
                f"engine.megatron.tensor_parallel_size ({self.tensor_parallel_size}) does not "
                f"divide job.ranks ({ranks}): the trainer ranks split into tensor-parallel "
                "groups, data-parallel size = job.ranks / tensor_parallel_size"
            )

    def trainer_footprint(self, ranks: int) -> TrainerFootprint:
        """Tensor-parallel layers; on CUDA megatron's distributed optimizer also splits AdamW's
        moments over the data-parallel ranks (on CPU torch's AdamW keeps them whole)."""
        distributed_optimizer = self.device != "cpu"
        return TrainerFootprint(
            tensor_parallel=self.tensor_parallel_size,
            tp_key="engine.megatron.tensor_parallel_size",
            parameter_shards=self.tensor_parallel_size,
            optimizer_shards=ranks if distributed_optimizer else self.tensor_parallel_size,
            compute_bytes=4,  # float32 on every device (see param_dtype)
            sync_bytes=DTYPE_BYTES[self.param_dtype],
            gathers_layers=False,
            micro_batch=self.micro_batch_size,
        )

    def trained_model(self) -> TrainedModel:
        """The model directory's model: every rollout engine starts from it."""
        where = f"engine.megatron.model_dir: {self.model_dir}"
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
            where=f"engine.megatron.model_dir {self.model_dir}",
        )
