"""The task's tokens (task.py): ten digits, then BOS, SEP and EOS; a prompt is `BOS d.. SEP`
(the digit once to `PROMPT_DIGITS` times), its answer `d` `ANSWER_DIGITS` times, then EOS.

No torch here, so that the settings (spec.py) can check a model's vocabulary against them.
"""

DIGITS = 10
BOS = 10
SEP = 11
EOS = 12
MIN_VOCAB = 13  # the digits, BOS, SEP and EOS
PROMPT_DIGITS = 3  # a prompt says its digit 1, 2 or 3 times: prompts of three lengths
PROMPT_TOKENS = PROMPT_DIGITS + 2  # the longest prompt
ANSWER_DIGITS = 3  # the right completion: the digit this many times, then EOS
