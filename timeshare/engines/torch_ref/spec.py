"""Settings of the reference engine pair (`[engine.torch_ref]`): model, task, sampling, GRPO."""

from __future__ import annotations

from typing import Annotated

import msgspec

from timeshare.engines.torch_ref.model import ModelConfig
from timeshare.engines.torch_ref.task import MIN_VOCAB, PROMPT_TOKENS
from timeshare.errors import ConfigError

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class TorchRefSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelConfig = ModelConfig()
    model_dir: str = ""  # a local checkpoint (config.json + state dict) instead of `model`
    seed: int = 0
    # intra-op threads per worker process: a trainer and a rollout share each rank's cores, and
    # spinning OpenMP pools of several processes on few cores stall each other for a second
    torch_threads: PositiveInt = 1
    # the task and the rollout
    prompts_per_rank: PositiveInt = 8
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 8  # GRPO needs a group to compare within
    completion_tokens: PositiveInt = 6
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    kv_cache_len: PositiveInt = 64  # tokens per sequence the KV cache holds
    # GRPO and AdamW
    lr: Annotated[float, msgspec.Meta(gt=0.0)] = 3e-3
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    clip_ratio_low: Fraction = 0.2
    clip_ratio_high: Annotated[float, msgspec.Meta(ge=0.0)] = 0.28
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # 0: no reference model kept
    minibatches: PositiveInt = 2

    def __post_init__(self) -> None:
        if self.model.vocab_size < MIN_VOCAB:
            raise ConfigError(
                f"engine.torch_ref.model.vocab_size ({self.model.vocab_size}) must be at least "
                f"{MIN_VOCAB}: the task uses ten digits, BOS and SEP"
            )
        if PROMPT_TOKENS + self.completion_tokens > self.kv_cache_len:
            raise ConfigError(
                f"engine.torch_ref.kv_cache_len ({self.kv_cache_len}) is shorter than a prompt "
                f"({PROMPT_TOKENS}) plus completion_tokens ({self.completion_tokens})"
            )
        if self.kv_cache_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"engine.torch_ref.kv_cache_len ({self.kv_cache_len}) exceeds "
                f"model.max_position_embeddings ({self.model.max_position_embeddings})"
            )
        if (self.prompts_per_rank * self.group_size) % self.minibatches:
            raise ConfigError(
                f"engine.torch_ref.minibatches ({self.minibatches}) does not divide a rank's "
                f"batch of {self.prompts_per_rank * self.group_size} samples"
            )

    @property
    def batch_size(self) -> int:
        """Sequences a rank's rollout generates per step (and its KV cache holds)."""
        return self.prompts_per_rank * self.group_size
