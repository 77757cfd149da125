"""Settings of the reference engine pair (`[engine.torch_ref]`): model, task, sampling, GRPO.

No torch: the job config is read without it (model.py builds the model from `ModelConfig`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import msgspec

from timeshare.engines.torch_ref.vocab import MIN_VOCAB, PROMPT_TOKENS
from timeshare.errors import ConfigError

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys of a transformers LlamaConfig that the model (model.py) uses."""

    vocab_size: int = 16
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: Path) -> ModelConfig:
        """Read a transformers `config.json`, keeping the keys this model uses."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot read a transformers config: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a transformers config is a JSON object")
        rope = data.get("rope_parameters")  # transformers 5 keeps rope_theta there
        if isinstance(rope, dict) and "rope_theta" in rope:
            data.setdefault("rope_theta", rope["rope_theta"])
        fields = set(cls.__struct_fields__)
        try:
            return msgspec.convert({k: v for k, v in data.items() if k in fields}, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    @classmethod
    def servable(cls, directory: Path) -> ModelConfig:
        """The config of a transformers directory the reference rollout can serve: a Llama
        without biases, default rotary embedding and head_dim = hidden_size / heads."""
        path = directory / "config.json"
        config = cls.from_json(path)
        data = json.loads(path.read_text())
        why = _unservable(data, config)
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
        # Whether the KV cache fits the model is checked where the model is known: the FSDP
        # trainer's is not this section's (EngineSpec, config.load_config).
        self.check_vocab(self.model, "engine.torch_ref.model")
        if PROMPT_TOKENS + self.completion_tokens > self.kv_cache_len:
            raise ConfigError(
                f"engine.torch_ref.kv_cache_len ({self.kv_cache_len}) is shorter than a prompt "
                f"({PROMPT_TOKENS}) plus completion_tokens ({self.completion_tokens})"
            )
        if (self.prompts_per_rank * self.group_size) % self.minibatches:
            raise ConfigError(
                f"engine.torch_ref.minibatches ({self.minibatches}) does not divide a rank's "
                f"batch of {self.prompts_per_rank * self.group_size} samples"
            )

    def check_model(self, model: ModelConfig, where: str) -> None:
        """A `ConfigError` if the task cannot run on `model` (`where`: the model's key or path)."""
        self.check_vocab(model, where)
        if self.kv_cache_len > model.max_position_embeddings:
            raise ConfigError(
                f"engine.torch_ref.kv_cache_len ({self.kv_cache_len}) exceeds "
                f"max_position_embeddings ({model.max_position_embeddings}) of {where}"
            )

    @staticmethod
    def check_vocab(model: ModelConfig, where: str) -> None:
        if model.vocab_size < MIN_VOCAB:
            raise ConfigError(
                f"{where}: vocab_size ({model.vocab_size}) must be at least {MIN_VOCAB}: the "
                "task uses ten digits, BOS and SEP"
            )

    @property
    def batch_size(self) -> int:
        """Sequences a rank's rollout generates per step (and its KV cache holds)."""
        return self.prompts_per_rank * self.group_size


def model_config(spec: TorchRefSpec) -> ModelConfig:
    """The model the pair trains: the local checkpoint's config.json, else `spec.model`."""
    if spec.model_dir:
        return ModelConfig.from_json(Path(spec.model_dir) / "config.json")
    return spec.model
