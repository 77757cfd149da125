"""The job's RL side, engine-free: its data, tokenizing and chat templates, the stop set.

    vocab.py            the digit task's token ids and strings (no torch: settings read them)
    files.py            what a model directory's tokenizer and generation config say, read as
                        JSON (no transformers: a config's checks read them), and the stop set
    tokenizer.py        the tokenizer, as the rollout worker alone uses it: a chat rendered to
                        text and encoded once; completions decoded
    digit_tokenizer.py  the digit task's tokenizer, built offline with `tokenizers`
    digits.py           the digit task's data: chat prompts and the answers they want

Engines import this package, never the reverse.
"""
