"""Transformers model directories made offline: a random-initialised model from a seed.

    timeshare model init --arch llama|qwen2 --layers N --hidden H ... DIR

writes `config.json` and `model.safetensors` that transformers' `from_pretrained` and vLLM load
(never a hub download). The same arguments and seed give the same weights, bit for bit: the
initialisation runs on a forked RNG seeded from `seed`, so the caller's RNG is untouched. This is
the model the examples and tests start from; a user points the engines at their own directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from timeshare.engines.model_config import ModelConfig
from timeshare.errors import ConfigError
from timeshare.task import digit_tokenizer
from timeshare.task.files import GENERATION_CONFIG
from timeshare.task.vocab import BOS, EOS, MIN_VOCAB, TOKENIZER_SIZE

INDEX_FILE = "model.safetensors.index.json"

Arch = Literal["llama", "qwen2"]
# transformers' (config class, model class) of each architecture
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


@dataclass(frozen=True)
class ModelShape:
    arch: Arch = "llama"
    layers: int = 2
    hidden: int = 64
    intermediate: int = 128
    heads: int = 2
    kv_heads: int = 2
    vocab: int = 16
    max_positions: int = 64
    tie_embeddings: bool = False

    def check(self) -> None:
        """A `ConfigError` naming the first argument a model cannot have."""
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"--arch {self.arch!r}: one of {', '.join(sorted(ARCHITECTURES))}")
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_positions < 2:
            raise ConfigError("--max-positions must be at least 2")
        if self.vocab < TOKENIZER_SIZE:
            raise ConfigError(
                f"--vocab ({self.vocab}) is smaller than the digit task's tokenizer "
                f"({TOKENIZER_SIZE} tokens), which the directory holds"
            )
        if self.hidden % self.heads:
            raise ConfigError(
                f"--hidden ({self.hidden}) is not a multiple of --heads ({self.heads})"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"--heads ({self.heads}) is not a multiple of --kv-heads ({self.kv_heads})"
            )

    def transformers_config(self) -> dict[str, object]:
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden // self.heads,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tie_embeddings,
        }


def init_model_dir(directory: Path, shape: ModelShape, seed: int) -> Path:
    """Write a random-initialised model of `shape` from `seed` into `directory` (new or empty),
    with the digit task's tokenizer (timeshare/task/digit_tokenizer.py: tokenizer.json and
    tokenizer_config.json with its chat template); config.json and generation_config.json name
    the tokenizer's BOS, EOS and PAD (transformers' Llama defaults would put EOS on a digit)."""
    shape.check()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"{directory}: exists and is not an empty directory")
    # Imported here: the command line starts without torch, and transformers is an extra.
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    config_class, model_class = (getattr(transformers, name) for name in ARCHITECTURES[shape.arch])
    config = config_class(
        **shape.transformers_config(), **digit_tokenizer.SPECIAL_IDS, torch_dtype="float32"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    generation = directory / GENERATION_CONFIG  # (save_pretrained's, when it wrote one)
    values = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**values, **digit_tokenizer.SPECIAL_IDS}, indent=2) + "\n")
    digit_tokenizer.save(directory)
    return directory


def write_config_dir(config: ModelConfig, directory: Path) -> Path:
    """A transformers config.json for the trainer's model and no weights: an engine reads the
    architecture from it and starts from dummy weights, which the first SYNC replaces.

    It names the task's special tokens (vocab.py), and generation_config.json the same: an
    engine that reads the model's EOS from either (vLLM's generation config, SGLang's
    `hf_eos_token_id`) finds the job's EOS, never transformers' Llama defaults (BOS 1, EOS 2:
    digits of the task). The pad token is no digit: the first id past the task's, where the
    vocabulary has one, else EOS."""
    directory.mkdir(parents=True, exist_ok=True)
    special = {
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": MIN_VOCAB if config.vocab_size > MIN_VOCAB else EOS,
    }
    values = msgspec.to_builtins(config)
    values.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        head_dim=config.head_dim,
        torch_dtype="float32",
        attention_bias=False,
        mlp_bias=False,
        **special,
    )
    (directory / "config.json").write_text(json.dumps(values, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(special, indent=2))
    return directory


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: those its index names, else every one."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        return sorted({directory / name for name in weight_map.values()})
    return sorted(directory.glob("*.safetensors"))


SHOWN = 5  # names listed in an error before "and N more"


def weights_problem(directory: Path, where: str, expected: dict[str, tuple[int, ...]]) -> str:
    """What is wrong with a model directory's safetensors against the tensors a model expects
    (name -> shape; a head the weights hold beyond them is allowed: a tied model's), read from
    the files' headers alone ("": nothing). `where` names the directory in the answer."""
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415 - an extra's

    files = weight_files(directory)
    if not files:
        return f"{where} has no *.safetensors weights"
    found: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as tensors:
                for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    found[name] = tuple(tensors.get_slice(name).get_shape())
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            return f"{where}: cannot read {path.name}: {_first_line(exc)}"
    missing = sorted(set(expected) - set(found))
    if missing:
        return f"{where}: {len(missing)} tensors missing from its weights: {_names(missing)}"
    unexpected = sorted(set(found) - set(expected) - {"lm_head.weight"})
    if unexpected:
        return f"{where}: {len(unexpected)} tensors the model does not have: {_names(unexpected)}"
    wrong = [
        f"{n} {found[n]} (expected {expected[n]})" for n in expected if found[n] != expected[n]
    ]
    if wrong:
        return f"{where}: {len(wrong)} tensors of the wrong shape: {_names(wrong)}"
    return ""


def _names(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
