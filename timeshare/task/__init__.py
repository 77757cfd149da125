"""The job's RL side, engine-free: its data, tokenizing and chat templates, rewards, GRPO's maths.

    vocab.py            the digit task's token ids and strings (no torch: settings read them)
    files.py            what a model directory's tokenizer and generation config say, read as
                        JSON (no transformers: a config's checks read them), and the stop set
    tokenizer.py        the tokenizer, as the rollout worker alone uses it: a chat rendered to
                        text and encoded once; completions decoded
    digit_tokenizer.py  the digit task's tokenizer, built offline with `tokenizers`
    digits.py           the digit task's data: chat prompts and the answers they want
    dataset.py          a dataset's rows read by index (parquet by row group, JSON lines by
                        offset: memory does not grow with the file), and which rows each rank
                        takes at each step: a function of (seed, step, rank)
      dataset_files.py  each file format's reader
    prompts.py          a dataset's prompts as a job uses them: every row tokenized once, the
                        overlong ones found, the data's fingerprint
    reward_function.py  the user's reward function: [engine.task.reward], loading it, binding
                        its parameters by name, checking what it returns
    reward_pool.py      the processes that run it (spawned; a hard kill past timeout_s)
      reward_child.py   the main of one of them
    scoring.py          what a failing reward does: reward_errors.jsonl, then fail or skip
    aggregation.py      the names of the loss aggregations (no torch: settings read them)
    grpo_math.py        GRPO's maths: group advantages, token weights, the clipped loss
    seeds.py            one seed mixed from several numbers

Engines import this package, never the reverse. The built-in rewards a job names are
`timeshare.rewards` (exact_match, math).
"""
