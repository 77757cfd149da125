"""The digit task's tokens: ten digits, then BOS, SEP and EOS, then the tokenizer's PAD and UNK.

A prompt renders to `BOS d.. SEP` (the digit once to `PROMPT_DIGITS` times), its answer is `d`
`ANSWER_DIGITS` times, then EOS. The digit task's tokenizer (digit_tokenizer.py) gives these
ids, so that a model learns the same thing whether its prompts were written as ids or as text.

No torch here, so that the settings (engines/spec.py) can check a model's vocabulary against them.
"""

DIGITS = 10  # ids 0-9: the digits "0".."9"
BOS = 10
SEP = 11
EOS = 12
MIN_VOCAB = 13  # the digits, BOS, SEP and EOS: the ids the task uses
PAD = 13  # the tokenizer's own (never in a prompt or an answer)
UNK = 14
PROMPT_DIGITS = 3  # a prompt says its digit 1, 2 or 3 times: prompts of three lengths
PROMPT_TOKENS = PROMPT_DIGITS + 2  # the longest prompt
ANSWER_DIGITS = 1  # the right completion: the digit this many times (once), then EOS

# The tokenizer's strings of the ids above
BOS_TEXT, SEP_TEXT, EOS_TEXT, PAD_TEXT, UNK_TEXT = "<bos>", "<sep>", "<eos>", "<pad>", "<unk>"
SPECIAL = {BOS_TEXT: BOS, SEP_TEXT: SEP, EOS_TEXT: EOS, PAD_TEXT: PAD, UNK_TEXT: UNK}
TOKENIZER_SIZE = len(SPECIAL) + DIGITS
