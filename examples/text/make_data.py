"""Write the text example's data: prompts of two to four digits, each labelled with its last.

    python examples/text/make_data.py DIR     writes DIR/train.parquet and DIR/val.jsonl

The model `timeshare model init` makes reads digits only (its tokenizer is the digit task's), so
the text is digits and spaces. Prompts are chats of one user turn: the train rows in parquet, the
validation rows in JSON lines (the two files a user's data comes in). Seeded: the same files each
time.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TRAIN_ROWS = 2000
VAL_ROWS = 32


def row(rng: random.Random) -> tuple[str, str]:
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(2, 4))]
    return " ".join(digits), digits[-1]


def main(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train = [row(rng) for _ in range(TRAIN_ROWS)]
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": text}] for text, _ in train],
            "answer": [answer for _, answer in train],
            "data_source": ["last_digit"] * len(train),
        }
    )
    pq.write_table(table, directory / "train.parquet", row_group_size=500)
    with (directory / "val.jsonl").open("w") as out:
        for _ in range(VAL_ROWS):
            text, answer = row(rng)
            chat = [{"role": "user", "content": text}]
            out.write(json.dumps({"prompt": chat, "answer": answer}) + "\n")
    print(f"wrote {directory}/train.parquet ({TRAIN_ROWS} rows), {directory}/val.jsonl")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/text-grpo/data"))
