"""The model a job trains, as every engine reads it: its Llama keys, and where its weights start.

A trainer says which model it trains (`TrainedModel`, from its own settings); a rollout engine
that builds its own copy of the model (the reference rollout, vLLM) reads it from there, so that
no rollout needs to know which trainer it serves. No torch here: the job config is read without.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from timeshare.errors import ConfigError


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys of a transformers LlamaConfig that the reference model (torch_ref) uses."""

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
        data = read_config_json(path)
        rope = data.get("rope_parameters")  # transformers 5 keeps rope_theta there
        if isinstance(rope, dict) and "rope_theta" in rope:
            data.setdefault("rope_theta", rope["rope_theta"])
        fields = set(cls.__struct_fields__)
        try:
            return msgspec.convert({k: v for k, v in data.items() if k in fields}, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{path}: {exc}") from exc


def read_config_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read a transformers config: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a transformers config is a JSON object")
    return data


class TrainedModel(msgspec.Struct, frozen=True, kw_only=True):
    """The model a job's trainer trains.

    `config`: its Llama keys. `directory`: a transformers directory (config.json and
    safetensors) holding its initial weights, which an engine may load at start-up; "": none
    (the engine starts from dummy weights and the first SYNC brings the trainer's).
    """

    config: ModelConfig
    directory: str = ""
    where: str = ""  # the key that names it, for errors ("engine.fsdp.model_dir runs/model")
    # The model's own directory when `directory` is none (torch_ref's checkpoint: config.json
    # and a state dict): its tokenizer and generation_config.json are there too
    files: str = ""

    @property
    def home(self) -> str:
        """The directory of the model's files (tokenizer, generation config); "": inline."""
        return self.directory or self.files


@runtime_checkable
class TrainsModel(Protocol):
    """A trainer's settings that say which model it trains (torch_ref's, FSDP's)."""

    def trained_model(self) -> TrainedModel: ...


@runtime_checkable
class SplitsRanks(Protocol):
    """A trainer's settings that split the job's ranks into groups (Megatron's tensor-parallel
    groups): whether `job.ranks` splits is checked when the config is loaded."""

    def check_ranks(self, ranks: int) -> None: ...
