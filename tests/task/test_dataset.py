"""A dataset of prompts: rows read by index across files and row groups equal the source data,
errors name the file and what was wrong, a step's positions are a pure function of
(seed, step, rank), and a large parquet file is read without holding it as Python objects."""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from timeshare.errors import ConfigError
from timeshare.task.dataset import PromptRows, Row, positions


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 3) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, rows: list[Any], blank_lines: bool = False) -> Path:
    lines = [json.dumps(row) for row in rows]
    if blank_lines:
        lines = [*lines[:2], "", "\r", *lines[2:]]
    path.write_text("\n".join(lines) + "\n")
    return path


PARQUET = [{"prompt": f"p{i}", "answer": i, "meta": {"tag": f"t{i}"}} for i in range(10)]
JSONL = [{"prompt": f"j{i}", "answer": str(i), "extra": [i, None]} for i in range(5)]
JSON = [{"prompt": f"a{i}", "answer": i * 1.5} for i in range(4)]


@pytest.fixture
def three_files(tmp_path: Path) -> list[Path]:
    (tmp_path / "three.json").write_text(json.dumps(JSON))
    return [
        write_parquet(tmp_path / "one.parquet", PARQUET),  # row groups of 3, 3, 3, 1
        write_jsonl(tmp_path / "two.jsonl", JSONL, blank_lines=True),
        tmp_path / "three.json",
    ]


def test_rows_across_files_and_row_groups_equal_the_source(three_files: list[Path]) -> None:
    source = PARQUET + JSONL + JSON
    with PromptRows.open(three_files, prompt_key="prompt", label_key="answer") as rows:
        assert len(rows) == 19
        indices = [18, 0, 2, 3, 9, 10, 14, 15, 3, 0, 7, 11]  # boundaries, out of order, twice
        got = rows.rows(indices)
        assert [row.index for row in got] == indices
        assert [row.columns for row in got] == [source[i] for i in indices]
        assert [row.prompt for row in got] == [source[i]["prompt"] for i in indices]
        assert [row.label for row in got] == [source[i]["answer"] for i in indices]
        assert list(rows.iter_rows(batch_rows=2)) == rows.rows(range(19))
        assert rows.rows([]) == []
        with pytest.raises(IndexError, match="row 19 is out of range"):
            rows.rows([19])
        with pytest.raises(IndexError):
            rows.rows([-1])


def test_no_label_key_gives_none(three_files: list[Path]) -> None:
    with PromptRows.open(three_files[1:], prompt_key="prompt") as rows:
        assert rows.rows([1]) == [Row(1, "j1", None, JSONL[1])]


def test_chat_prompts_from_parquet_and_jsonl(tmp_path: Path) -> None:
    data = [{"messages": chat(f"q{i}"), "answer": f"{i}"} for i in range(4)]
    files = [
        write_parquet(tmp_path / "chat.parquet", data, row_group_size=2),
        write_jsonl(tmp_path / "chat.jsonl", data),
    ]
    with PromptRows.open(files, prompt_key="messages", label_key="answer") as rows:
        assert [row.prompt for row in rows.rows([1, 5, 3])] == [chat("q1"), chat("q1"), chat("q3")]
        assert [row.prompt for row in rows.iter_rows()] == [d["messages"] for d in data * 2]


def test_chat_fields_arrow_filled_with_none_are_dropped_from_the_prompt(tmp_path: Path) -> None:
    data = [
        {"p": [{"role": "user", "content": "hi", "name": "ann"}]},
        {"p": [{"role": "user", "content": "ho"}]},
    ]
    with PromptRows.open([write_parquet(tmp_path / "a.parquet", data)], prompt_key="p") as rows:
        first, second = rows.rows([0, 1])
        assert first.prompt == [{"role": "user", "content": "hi", "name": "ann"}]
        assert second.prompt == [{"role": "user", "content": "ho"}]
        assert second.columns["p"] == [{"role": "user", "content": "ho", "name": None}]


def test_arrow_values_become_json_like(tmp_path: Path) -> None:
    import datetime
    import decimal

    table = pa.table(
        {
            "prompt": ["x"],
            "when": pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5)], pa.timestamp("s")),
            "price": pa.array([decimal.Decimal("1.25")], pa.decimal128(5, 2)),
            "raw": pa.array([b"bytes"], pa.binary()),
            "map": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64())),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    with PromptRows.open([tmp_path / "t.parquet"], prompt_key="prompt") as rows:
        assert rows.rows([0])[0].columns == {
            "prompt": "x",
            "when": "2024-01-02T03:04:05",
            "price": 1.25,
            "raw": "bytes",
            "map": [["k", 1]],
        }


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([], r"engine\.task\.train_files: no files"),
        (["missing.parquet"], r"train_files: .*missing\.parquet: no such file"),
        (["data.csv"], r"train_files: .*data\.csv: unknown extension '\.csv'; want one of"),
        (["one.parquet", "empty.jsonl"], None),  # an empty file among others is fine
        (["empty.jsonl"], r"train_files: the dataset is empty"),
        (["bad.parquet"], r"bad\.parquet: not a readable parquet file: .*Parquet"),
        (["bad.json"], r"bad\.json: not JSON: Expecting"),
        (["object.json"], r"object\.json: want one JSON array of objects, not dict"),
        (["numbers.json"], r"numbers\.json: element 1 is not a JSON object but int 2"),
        (["first.jsonl"], r"first\.jsonl: line 1 is not JSON"),
    ],
)
def test_files_that_cannot_work_are_named(
    tmp_path: Path, files: list[str], message: str | None, three_files: list[Path]
) -> None:
    (tmp_path / "data.csv").write_text("prompt\nx\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "object.json").write_text('{"data": []}')
    (tmp_path / "numbers.json").write_text('[{"prompt": "x"}, 2]')
    (tmp_path / "first.jsonl").write_text("{oops\n")
    paths = [tmp_path / name for name in files]
    if message is None:
        PromptRows.open(paths, prompt_key="prompt").close()
        return
    with pytest.raises(ConfigError, match=message):
        PromptRows.open(paths, prompt_key="prompt")


def test_a_missing_column_lists_the_columns_there_are(three_files: list[Path]) -> None:
    with pytest.raises(
        ConfigError,
        match=r"train_files: .*one\.parquet: no column 'question' \(engine\.task\.prompt_key\); "
        r"its columns are 'prompt', 'answer', 'meta'",
    ):
        PromptRows.open(three_files, prompt_key="question")
    with pytest.raises(
        ConfigError,
        match=r"two\.jsonl: no column 'label' \(engine\.task\.label_key\); "
        r"its columns are 'prompt', 'answer', 'extra'",
    ):
        PromptRows.open(three_files[1:], prompt_key="prompt", label_key="label")
    with pytest.raises(ConfigError, match=r"^data\.files: .*two\.jsonl: no column 'label'"):
        PromptRows.open(three_files[1:], prompt_key="prompt", label_key="label", where="data.files")


def test_a_bad_json_line_is_named_by_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    lines = [json.dumps({"prompt": "a"}), "", json.dumps({"prompt": "b"}), "[1, 2]", "{broken"]
    path.write_text("\n".join(lines) + "\n")
    with PromptRows.open([path], prompt_key="prompt") as rows:
        assert len(rows) == 4
        assert rows.rows([1])[0].prompt == "b"
        with pytest.raises(
            ConfigError, match=r"lines\.jsonl: line 4 is not a JSON object but list"
        ):
            rows.rows([2])
        with pytest.raises(ConfigError, match=r"lines\.jsonl: line 5 is not JSON"):
            rows.rows([3])
        walked = rows.iter_rows()
        assert [next(walked).prompt, next(walked).prompt] == ["a", "b"]
        with pytest.raises(ConfigError, match=r"lines\.jsonl: line 4 is not a JSON object"):
            next(walked)


def test_a_row_without_the_prompt_key_is_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with (
        PromptRows.open([path], prompt_key="prompt") as rows,
        pytest.raises(
            ConfigError,
            match=r"k\.jsonl: line 2 \(dataset row 1\): no key 'prompt'; it has 'question'",
        ),
    ):
        rows.rows([1])


@pytest.mark.parametrize(
    "prompt",
    [7, None, [], ["hello"], [{"role": "user"}], [{"role": "user", "content": 3}], {"a": "b"}],
)
def test_a_prompt_neither_text_nor_chat_is_named(
    tmp_path: Path, prompt: object, three_files: list[Path]
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "fine"}, {"prompt": "fine"}, {"prompt": prompt}]))
    with PromptRows.open([three_files[2], path], prompt_key="prompt") as rows:
        assert rows.rows([5])[0].prompt == "fine"
        kind = type(prompt).__name__
        with pytest.raises(
            ConfigError,
            match=rf"p\.json: element 2 \(dataset row 6\): the prompt \('prompt'\) is {kind} ",
        ):
            rows.rows([6])


def test_positions_are_a_pure_function_of_seed_step_and_rank() -> None:
    assert positions(1, 5, 2, 4, 8, 1000) == positions(1, 5, 2, 4, 8, 1000)
    assert positions(1, 5, 2, 4, 8, 1000) != positions(2, 5, 2, 4, 8, 1000)
    assert positions(1, 5, 2, 4, 8, 1000) != positions(1, 6, 2, 4, 8, 1000)
    assert all(0 <= p < 1000 for p in positions(3, 0, 0, 1, 1000, 1000))


def test_each_epoch_uses_every_row_once_in_disjoint_windows() -> None:
    rows, ranks, count = 48, 4, 3  # an epoch is 4 steps
    epochs = []
    for epoch in range(3):
        steps = range(epoch * 4, epoch * 4 + 4)
        windows = [positions(9, s, r, ranks, count, rows) for s in steps for r in range(ranks)]
        seen = [p for window in windows for p in window]
        assert sorted(seen) == list(range(rows))  # each row once: the windows are disjoint
        epochs.append(seen)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(rows))
    # A window crossing an epoch's end goes on into the next epoch's permutation.
    assert positions(9, 0, 0, 1, 60, rows) == epochs[0] + epochs[1][:12]


def test_without_shuffle_positions_are_the_rows_in_order() -> None:
    assert positions(9, 1, 1, 2, 3, 10, shuffle=False) == [9, 0, 1]
    assert positions(9, 0, 0, 1, 25, 10, shuffle=False) == [*range(10), *range(10), *range(5)]


def test_positions_refuse_what_cannot_be() -> None:
    with pytest.raises(ValueError, match="rank 4 of 4"):
        positions(0, 1, 4, 4, 1, 10)
    with pytest.raises(ValueError, match="rows must be at least 1"):
        positions(0, 1, 0, 1, 1, 0)
    assert positions(0, 1, 0, 1, 0, 10) == []


def test_the_fingerprint_follows_the_data_and_keys(three_files: list[Path]) -> None:
    def fingerprint(label_key: str = "answer", prompt_key: str = "prompt") -> str:
        with PromptRows.open(three_files, prompt_key=prompt_key, label_key=label_key) as rows:
            return rows.fingerprint()

    first = fingerprint()
    assert first == fingerprint()
    assert len(first) == 32
    assert fingerprint(label_key="") != first
    three_files[1].write_bytes(three_files[1].read_bytes().replace(b'"j3"', b'"jx"'))
    assert fingerprint() != first
    three_files[1].write_bytes(three_files[1].read_bytes().replace(b'"jx"', b'"j3"'))
    assert fingerprint() == first


def test_a_renamed_prompt_key_changes_the_fingerprint(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "k.jsonl", [{"a": "x", "b": "y"}])
    with (
        PromptRows.open([path], prompt_key="a") as a,
        PromptRows.open([path], prompt_key="b") as b,
    ):
        assert a.fingerprint() != b.fingerprint()


def test_closing_releases_the_files(three_files: list[Path]) -> None:
    rows = PromptRows.open(three_files, prompt_key="prompt")
    rows.close()
    rows.close()
    with pytest.raises(ValueError, match="closed"):
        rows.rows([0])


def test_a_large_parquet_file_is_read_by_row_group(tmp_path: Path) -> None:
    count = 200_000
    table = pa.table(
        {
            "prompt": pa.array([f"prompt number {i} " * 4 for i in range(count)]),
            "answer": pa.array(range(count), pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=10_000)
    del table
    began = time.monotonic()
    with PromptRows.open(
        [tmp_path / "big.parquet"], prompt_key="prompt", label_key="answer"
    ) as rows:
        assert len(rows) == count
        picked = random.Random(0).sample(range(count), 64)
        arrow_before = pa.total_allocated_bytes()
        tracemalloc.start()
        try:
            got = rows.rows(picked)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert [row.label for row in got] == picked
        assert got[5].prompt == f"prompt number {picked[5]} " * 4
        # As Python objects the file takes about 75 MB; 64 rows a few kB (and the first call
        # to pyarrow's conversions a few MB of its own, once).
        assert peak < 16 * 2**20
        # Arrow memory: the cached row groups (2 of 20, about 1 MB each), not the file (19 MB).
        assert pa.total_allocated_bytes() - arrow_before < 8 * 2**20
        total = 0
        for total, row in enumerate(rows.iter_rows(batch_rows=4096), start=1):  # noqa: B007
            assert row.label == row.index
        assert total == count
    assert time.monotonic() - began < 10


def test_a_dotted_label_key_reads_into_a_column_of_dicts(tmp_path: Path) -> None:
    """verl's GSM8K files keep the answer in reward_model.ground_truth."""
    path = tmp_path / "gsm8k.parquet"
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "1 + 1?"}]],
            "reward_model": [{"style": "rule", "ground_truth": "2"}],
        }
    )
    pq.write_table(table, path)
    with PromptRows.open(
        [path], prompt_key="prompt", label_key="reward_model.ground_truth"
    ) as rows:
        assert rows.rows([0])[0].label == "2"
    with (
        PromptRows.open([path], prompt_key="prompt", label_key="reward_model.answer") as rows,
        pytest.raises(ConfigError, match=r"no 'answer' in 'reward_model'"),
    ):
        rows.rows([0])
