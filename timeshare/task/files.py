"""What a model directory's tokenizer and generation config say, read as JSON, and the stop set.

No transformers and no torch here: a config's checks (engines/spec.py) read these when a config
is loaded, which must stay quick (tests/test_config.py). The rollout worker reads the same files
through transformers (tokenizer.py); both compute the stop set with `stop_set`, the one place.

Where the tokenizer comes from (`TokenizerSource`): `[engine.task] tokenizer` when set, else the
trained model's directory; a model given inline (no directory: `[engine.torch_ref.model]`) has
the digit task's tokenizer, built in memory (digit_tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from timeshare.errors import ConfigError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# A tokenizer's files, any of which transformers may need: what a copy of one takes along
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    *CHAT_TEMPLATE_FILES,
    "tokenizer.model",  # sentencepiece
    "vocab.json",  # byte-level BPE, with merges.txt
    "merges.txt",
    "vocab.txt",  # WordPiece
)
# One of these makes a directory hold a tokenizer (a tokenizer_config.json alone does not)
TOKENIZER_MODELS = (TOKENIZER_JSON, "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class TokenizerSource:
    """Where the job's tokenizer is. `directory`: a directory of tokenizer files; "": the digit
    task's own (the model is given inline). `where`: the key naming it, for errors.
    `model_dir`: the model's directory, whose generation_config.json adds its EOS to the stop
    set ("": none)."""

    directory: str
    where: str
    model_dir: str = ""

    @property
    def is_digit_task(self) -> bool:
        return not self.directory


def stop_set(*sources: Iterable[int]) -> tuple[int, ...]:
    """Every token that ends a completion: the union of the tokenizer's EOS, the generation
    config's EOS and the job's own `stop_token_ids`, in order. The one place it is computed:
    every engine receives it in `SamplingParams.stop_token_ids`."""
    return tuple(sorted({int(token) for source in sources for token in source}))


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_MODELS)


def has_chat_template(directory: Path) -> bool:
    if any((directory / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    return bool(_json(directory / TOKENIZER_CONFIG).get("chat_template"))


def generation_eos(model_dir: Path | None) -> tuple[int, ...]:
    """The model's generation EOS: generation_config.json's `eos_token_id` (one id or a list),
    or, with no such file, config.json's, from which transformers and vLLM build the
    generation config then (() when neither names one). The engines are told to stop at the
    job's stop set alone (vLLM with ignore_eos), so the model's own EOS must be in it."""
    if model_dir is None:
        return ()
    path = model_dir / GENERATION_CONFIG
    if not path.is_file():
        path = model_dir / "config.json"
    return _ids(_json(path).get("eos_token_id"), path)


@dataclass(frozen=True)
class TokenizerFacts:
    """What tokenizer.json and tokenizer_config.json say without transformers. `size`: one past
    the largest id (None: not in the JSON, a sentencepiece model); `eos`: the EOS ids (() when
    the JSON names none, or names a token it does not map)."""

    size: int | None
    eos: tuple[int, ...]


def tokenizer_facts(directory: Path) -> TokenizerFacts:
    """The size and EOS of the tokenizer in `directory`, from its JSON files."""
    ids = _token_ids(directory)
    config = _json(directory / TOKENIZER_CONFIG)
    special = _json(directory / "special_tokens_map.json")
    eos = config.get("eos_token", special.get("eos_token"))
    if isinstance(eos, dict):
        eos = eos.get("content")
    eos_ids = (ids[eos],) if isinstance(eos, str) and eos in ids else ()
    return TokenizerFacts(size=max(ids.values()) + 1 if ids else None, eos=eos_ids)


def _token_ids(directory: Path) -> dict[str, int]:
    """Every token of the tokenizer with its id, as far as its JSON files hold them."""
    ids: dict[str, int] = {}
    data = _json(directory / TOKENIZER_JSON)
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):  # WordLevel, WordPiece, BPE
        ids.update({str(k): int(v) for k, v in vocab.items()})
    elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
        ids.update({str(entry[0]): i for i, entry in enumerate(vocab) if entry})
    if not ids:
        vocab_json = _json(directory / "vocab.json")
        ids.update({str(k): int(v) for k, v in vocab_json.items() if isinstance(v, int)})
    added = data.get("added_tokens")
    for token in added if isinstance(added, list) else []:
        if isinstance(token, dict) and "content" in token and "id" in token:
            ids[str(token["content"])] = int(token["id"])
    decoder = _json(directory / TOKENIZER_CONFIG).get("added_tokens_decoder")
    for key, token in (decoder if isinstance(decoder, dict) else {}).items():
        if isinstance(token, dict) and "content" in token:
            ids[str(token["content"])] = int(key)
    return ids


def _ids(value: object, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, bool):
        raise ConfigError(f"{path}: eos_token_id is {value!r}, not a token id")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ConfigError(f"{path}: eos_token_id is {value!r}, not a token id or a list of them")


def _json(path: Path) -> dict[str, object]:
    """A JSON object file ({} when absent)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data
