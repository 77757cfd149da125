"""The digit task's tokenizer, built offline with the `tokenizers` library.

A word-level vocabulary: "0".."9" are ids 0-9, then <bos> 10, <sep> 11, <eos> 12 (the ids of
vocab.py, which the models learn), then <pad> and <unk>. Digits split one a token, with or
without spaces between them. Like a Llama tokenizer, it adds its BOS to a text encoded with
special tokens, and its chat template writes the BOS too: a rendered chat encoded with special
tokens would start with BOS twice, which tokenizer.py never does.

The chat template: a user turn is its text then <sep>, an assistant turn its text then <eos>,
all after one <bos>; so [{"role": "user", "content": "7 7"}] renders to "<bos>7 7<sep>", ids
[10, 7, 7, 11]. `timeshare model init` writes this tokenizer into the model's directory
(`save`); a model given inline uses it built in memory (`build`): the same tokenizer either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from timeshare.task.files import TOKENIZER_CONFIG, TOKENIZER_JSON
from timeshare.task.vocab import (
    BOS,
    BOS_TEXT,
    DIGITS,
    EOS,
    EOS_TEXT,
    PAD,
    PAD_TEXT,
    SEP_TEXT,
    SPECIAL,
    UNK_TEXT,
)

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}" + SEP_TEXT + "{% "
    "elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% "
    "else %}{{ raise_exception('the digit task has user and assistant turns only') }}{% endif %}"
    "{% endfor %}"
)
# What tokenizer_config.json and the in-memory tokenizer name as their special tokens
SPECIAL_TOKENS = {
    "bos_token": BOS_TEXT,
    "eos_token": EOS_TEXT,
    "pad_token": PAD_TEXT,
    "unk_token": UNK_TEXT,
    "sep_token": SEP_TEXT,
}
# config.json's and generation_config.json's ids: the tokenizer's (never transformers' Llama
# defaults, BOS 1 and EOS 2: digits of the task)
SPECIAL_IDS = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}


def backend() -> tokenizers.Tokenizer:
    """The tokenizer itself (the `tokenizers` library's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: PLC0415

    vocab = {str(d): d for d in range(DIGITS)} | SPECIAL
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TEXT))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer.add_special_tokens(list(SPECIAL))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TEXT} $A",
        pair=f"{BOS_TEXT} $A {BOS_TEXT} $B",
        special_tokens=[(BOS_TEXT, BOS)],
    )
    return tokenizer


def build() -> PreTrainedTokenizerFast:
    """The digit task's tokenizer as transformers holds one, built in memory."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    built: PreTrainedTokenizerFast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers' __init__ is (*args, **kwargs)
        tokenizer_object=backend(), chat_template=CHAT_TEMPLATE, **SPECIAL_TOKENS
    )
    return built


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: the special tokens, the chat template, the class that reads it."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }


def save(directory: Path) -> None:
    """Write the tokenizer into `directory`: tokenizer.json and tokenizer_config.json, which
    `AutoTokenizer.from_pretrained(directory, local_files_only=True)` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    backend().save(str(directory / TOKENIZER_JSON))
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
