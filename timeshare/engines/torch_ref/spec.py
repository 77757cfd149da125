"""`[engine.torch_ref]`: the reference engines' own settings (the model, the rollout's KV cache).

The task, the sampling and GRPO are the job's (`[engine.task]`, `[engine.grpo]`), the same for
every engine. No torch: the job config is read without it (model.py builds the model from
`ModelConfig`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec

from timeshare.engines.footprint import RolloutFootprint, TrainerFootprint
from timeshare.engines.model_config import ModelConfig, TrainedModel
from timeshare.errors import ConfigError
from timeshare.units import Seconds

if TYPE_CHECKING:
    from timeshare.engines.registry import Role
    from timeshare.engines.spec import EngineChoice


class TorchRefSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # The trainer's model: a local checkpoint (config.json + state dict), else `model` from `seed`.
    model: ModelConfig = ModelConfig()
    model_dir: str = ""
    seed: int = 0  # the random initialisation of `model`
    kv_cache_len: Annotated[int, msgspec.Meta(ge=1)] = 64  # tokens per sequence the rollout holds
    # A generate still running after this is aborted (the engine stays usable); None: 0.9 of
    # the ROLLOUT command's deadline, which it runs inside.
    generate_timeout_s: Seconds | None = None

    def trainer_footprint(self, ranks: int) -> TrainerFootprint:
        """A whole float32 copy of the model and of AdamW on every rank (gradients averaged)."""
        return TrainerFootprint(
            tensor_parallel=1,
            tp_key="",
            parameter_shards=1,
            optimizer_shards=1,
            compute_bytes=4,
            sync_bytes=4,
            gathers_layers=False,
            micro_batch=0,
        )

    def rollout_footprint(self, sequences: int) -> RolloutFootprint:
        """A float32 copy; a KV cache of kv_cache_len tokens for each sequence of the batch."""
        return RolloutFootprint(
            tensor_parallel=1,
            tp_key="",
            weight_bytes=4,
            kv_cache_bytes=None,
            kv_cache_tokens=self.kv_cache_len * sequences,
            memory_fraction=None,
            kv_key="engine.torch_ref.kv_cache_len",
            longest_sequence=self.kv_cache_len,
            longest_key="engine.torch_ref.kv_cache_len",
        )

    def trained_model(self) -> TrainedModel:
        """The model the reference trainer trains: the local checkpoint's config, else `model`.
        (Its checkpoint is not a transformers directory: other engines start from dummy
        weights, which the first SYNC replaces.)"""
        if self.model_dir:
            path = Path(self.model_dir) / "config.json"
            return TrainedModel(
                config=ModelConfig.from_json(path),
                where=f"engine.torch_ref.model_dir {path}",
                files=self.model_dir,
            )
        return TrainedModel(config=self.model, where="engine.torch_ref.model")


def check(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The reference rollout holds the task's sequences and computes the trainer's model."""
    own = spec.settings("torch_ref", TorchRefSpec)
    if "trainer" not in roles and (own.model_dir or own.model != ModelConfig()):
        raise ConfigError(
            f"engine.torch_ref.model{'_dir' if own.model_dir else ''}: the rollout serves the "
            f"trainer's model (engine.trainer = {spec.trainer!r}); leave it unset"
        )
    if "rollout" not in roles:
        return
    if spec.task.sequence_tokens > own.kv_cache_len:
        raise ConfigError(
            f"engine.torch_ref.kv_cache_len ({own.kv_cache_len}) is shorter than the longest "
            f"prompt and completion ({spec.task.sequence_tokens} tokens: "
            f"engine.task.max_prompt_tokens = {spec.task.max_prompt_tokens} plus "
            f"engine.task.max_completion_tokens = {spec.task.max_completion_tokens})"
        )
    trained = spec.served_model()
    if own.kv_cache_len > trained.config.max_position_embeddings:
        raise ConfigError(
            f"engine.torch_ref.kv_cache_len ({own.kv_cache_len}) exceeds "
            f"max_position_embeddings ({trained.config.max_position_embeddings}) of "
            f"{trained.where}"
        )


def probe(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's probe (registry.py): the reference rollout can compute the model of the
    trainer's directory. After the trainer's own probe, which names a directory transformers
    cannot read at all more precisely than this would."""
    trained = spec.served_model()
    if "rollout" in roles and trained.directory:
        servable(Path(trained.directory))


def servable(directory: Path) -> ModelConfig:
    """The config of a transformers directory the reference rollout can serve: a Llama
    without biases, default rotary embedding and head_dim = hidden_size / heads."""
    path = directory / "config.json"
    config = ModelConfig.from_json(path)
    why = _unservable(json.loads(path.read_text()), config)
    if why:
        raise ConfigError(
            f"{path}: the torch_ref rollout serves the Llama architecture only ({why}); "
            'use engine.rollout = "vllm" for this model'
        )
    return config


def _unservable(data: dict[str, object], config: ModelConfig) -> str:
    """Why the reference model cannot compute what `data` describes ("": it can)."""
    architectures = data.get("architectures") or []
    if architectures != ["LlamaForCausalLM"]:
        return f"architectures is {architectures}"
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            return f"{key} is set"
    if data.get("hidden_act", "silu") != "silu":
        return f"hidden_act is {data.get('hidden_act')!r}"
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        return f"rope_type is {rope.get('rope_type')!r}"
    if data.get("head_dim", config.head_dim) != config.head_dim:
        return f"head_dim is {data.get('head_dim')}, not hidden_size / num_attention_heads"
    return ""
