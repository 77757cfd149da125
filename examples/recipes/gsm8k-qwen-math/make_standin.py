"""A stand-in for the GSM8K recipe's user-supplied parts, to check the recipe with no Qwen:

    python examples/recipes/gsm8k-qwen-math/make_standin.py DIR

writes DIR/tokenizer (a byte-level tokenizer, built offline with `tokenizers`, with the special
tokens and ChatML template of Qwen2.5's instruct models: its ids are not Qwen's) and
DIR/train.parquet, DIR/test.parquet: eight GSM8K rows each, in the format verl's
examples/data_preprocess/gsm8k.py writes (a chat `prompt`, the answer in
`reward_model.ground_truth`). Point the recipe at them with
TIMESHARE_ENGINE__TASK__TOKENIZER, ..._TRAIN_FILES and ..._VAL_FILES.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
QUESTIONS = [
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "10",
    ),
    (
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the "
        "money she needs. Her parents decided to give her $15 for that purpose, and her "
        "grandparents twice as much as her parents. How much more money does Betty need to buy "
        "the wallet?",
        "5",
    ),
    (
        "James writes a 3-page letter to 2 different friends twice a week. How many pages does "
        "he write a year?",
        "624",
    ),
]


def tokenizer(directory: Path) -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL)
    made = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=CHATML,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    made.save_pretrained(directory)


def rows(split: str, count: int) -> pa.Table:
    picked = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    return pa.table(
        {
            "data_source": ["openai/gsm8k"] * count,
            "prompt": [[{"role": "user", "content": f"{q} {INSTRUCTION}"}] for q, _ in picked],
            "ability": ["math"] * count,
            "reward_model": [{"style": "rule", "ground_truth": a} for _, a in picked],
            "extra_info": [{"split": split, "index": i} for i in range(count)],
        }
    )


def main(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer(directory / "tokenizer")
    pq.write_table(rows("train", 8), directory / "train.parquet")
    pq.write_table(rows("test", 8), directory / "test.parquet")
    print(f"wrote {directory}/tokenizer, {directory}/train.parquet, {directory}/test.parquet")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
