"""The digit task's token ids, as the engines and their tests name them: the task's own, from
timeshare/task/vocab.py (its tokenizer, digit_tokenizer.py, gives exactly these ids).

No torch here, so that the settings (spec.py) can check a model's vocabulary against them.
"""

from timeshare.task.vocab import (
    ANSWER_DIGITS,
    BOS,
    DIGITS,
    EOS,
    MIN_VOCAB,
    PAD,
    PROMPT_DIGITS,
    PROMPT_TOKENS,
    SEP,
    TOKENIZER_SIZE,
)

__all__ = [
    "ANSWER_DIGITS",
    "BOS",
    "DIGITS",
    "EOS",
    "MIN_VOCAB",
    "PAD",
    "PROMPT_DIGITS",
    "PROMPT_TOKENS",
    "SEP",
    "TOKENIZER_SIZE",
]
