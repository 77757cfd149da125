"""The task's tokens (task.py): ten digits, then BOS and SEP; a prompt is `BOS d SEP`.

No torch here, so that the settings (spec.py) can check a model's vocabulary against them.
"""

DIGITS = 10
BOS = 10
SEP = 11
MIN_VOCAB = 12  # the digits, BOS and SEP
PROMPT_TOKENS = 3
