"""A dataset of prompts (`[engine.task] kind = "dataset"`): rows read by index, and which rows a
rank uses at a step.

The rows of a step are a pure function of (seed, step, rank) (`positions`): the dataset is
walked epoch after epoch, each epoch a seeded permutation of its rows, and step s takes the
next window of it. There is no loader state to save, so a run resumed at step k sees exactly
the prompts it would have seen, and a restarted rank needs nothing from the others.

The files (`train_files`: .parquet, .jsonl, .json, concatenated in order) are read by row on
demand, so that memory does not grow with them (dataset_files.py says how, per format). Each
row's prompt (`prompt_key`) is a string or a chat, a list of {role, content} messages; its label
(`label_key`, optional) is any value a reward reads.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from timeshare.errors import ConfigError
from timeshare.task.dataset_files import FileRows, open_file, short
from timeshare.task.seeds import mix

# The last part of the seed of an epoch's permutation: mix(seed, epoch, PERMUTATION_STREAM).
# (The digit task's examples use the tag 1, the sampling seeds 2: their streams are unrelated.)
PERMUTATION_STREAM = 3
FINGERPRINT_CHUNK = 4 * 2**20

Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class Row:
    """One row of the dataset."""

    index: int  # the row's place in the concatenated files (0-based)
    prompt: Prompt
    label: Any  # None when there is no label_key
    columns: dict[str, Any]  # every column of the row, as JSON-like Python values


class PromptRows:
    """The rows of a dataset's files, read by index."""

    def __init__(
        self, files: list[FileRows], *, prompt_key: str, label_key: str, where: str
    ) -> None:
        self._files = files
        self._ends: npt.NDArray[np.int64] = np.cumsum([len(f) for f in files], dtype=np.int64)
        self._prompt_key = prompt_key
        self._label_key = label_key
        self._where = where
        self._closed = False

    @classmethod
    def open(
        cls,
        files: Sequence[str | Path],
        *,
        prompt_key: str,
        label_key: str = "",
        where: str = "engine.task.train_files",
    ) -> PromptRows:
        """The rows of `files`, checked: each exists, has a known extension, can be read and
        has the `prompt_key` column (and `label_key`'s, unless it is ""), and the whole has a
        row. ConfigError naming `where` and the file otherwise."""
        if isinstance(files, str | Path):
            raise ConfigError(f"{where}: want a list of files, not one: [{str(files)!r}]")
        if not files:
            raise ConfigError(f"{where}: no files: name one .parquet, .jsonl or .json file")
        if not prompt_key:
            raise ConfigError(f"{_sibling(where, 'prompt_key')}: empty: name the prompt's column")
        opened: list[FileRows] = []
        try:
            for name in files:
                rows = open_file(Path(name), where)
                opened.append(rows)
                _check_columns(rows, where, prompt_key=prompt_key, label_key=label_key)
            if not any(len(rows) for rows in opened):
                raise ConfigError(f"{where}: the dataset is empty: no file holds a row")
            return cls(opened, prompt_key=prompt_key, label_key=label_key, where=where)
        except BaseException:
            for rows in opened:
                rows.close()
            raise

    def __len__(self) -> int:
        return int(self._ends[-1])

    def rows(self, indices: Sequence[int]) -> list[Row]:
        """The rows at `indices`, in that order (duplicates allowed); IndexError for an index
        outside [0, len). Reads each needed parquet row group once."""
        self._check_open()
        wanted = [operator.index(i) for i in indices]
        for index in wanted:
            if not 0 <= index < len(self):
                raise IndexError(f"row {index} is out of range: the dataset has {len(self)} rows")
        at = np.asarray(wanted, dtype=np.int64)
        owners = np.searchsorted(self._ends, at, side="right")
        found: list[Row | None] = [None] * len(wanted)
        for owner in np.unique(owners).tolist():
            places = np.flatnonzero(owners == owner).tolist()
            first = int(self._ends[owner - 1]) if owner else 0
            local = [wanted[p] - first for p in places]
            values = self._files[owner].read(local)
            for place, offset, columns in zip(places, local, values, strict=True):
                found[place] = self._row(owner, first + offset, offset, columns)
        return [row for row in found if row is not None]

    def iter_rows(self, batch_rows: int = 4096) -> Iterator[Row]:
        """Every row in order, with bounded memory: parquet `batch_rows` rows at a time, JSON
        lines one line at a time. A bad JSON line is reported by its line number."""
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be at least 1, not {batch_rows}")
        self._check_open()
        first = 0
        for owner, rows in enumerate(self._files):
            for offset, columns in enumerate(rows.iterate(batch_rows)):
                yield self._row(owner, first + offset, offset, columns)
            first += len(rows)

    def fingerprint(self) -> str:
        """A hex digest of the data: each file's name (basename), size and full content, and
        the prompt and label keys. The same data gives the same string, a byte changed a
        different one. Reads every file whole (in chunks): at the speed of the disk."""
        digest = xxhash.xxh3_128()

        def field(data: bytes) -> None:  # length-prefixed: no two sequences read alike
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)

        field(b"timeshare.task.dataset/1")
        for rows in self._files:
            field(rows.path.name.encode())
            with rows.path.open("rb") as handle:
                field_size = handle.seek(0, 2)
                handle.seek(0)
                digest.update(field_size.to_bytes(8, "little"))
                while chunk := handle.read(FINGERPRINT_CHUNK):
                    digest.update(chunk)
        field(self._prompt_key.encode())
        field(self._label_key.encode())
        return digest.hexdigest()

    def close(self) -> None:
        """Closes every file; idempotent."""
        self._closed = True
        for rows in self._files:
            rows.close()

    def __enter__(self) -> PromptRows:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self._where}: the dataset's files are closed")

    def _row(self, owner: int, index: int, offset: int, columns: dict[str, Any]) -> Row:
        rows = self._files[owner]

        def fail(what: str) -> ConfigError:
            return ConfigError(
                f"{self._where}: {rows.path}: {rows.place(offset)} (dataset row {index}): {what}"
            )

        for key in (self._prompt_key, _column(self._label_key)):
            if key and key not in columns:
                raise fail(f"no key {key!r}; it has {', '.join(map(repr, columns)) or 'none'}")
        value = columns[self._prompt_key]
        prompt = _prompt(value)
        if prompt is None:
            raise fail(
                f"the prompt ({self._prompt_key!r}) is {type(value).__name__} {short(value)}; "
                "want a string or a non-empty list of {role, content} messages of strings"
            )
        label = _nested(columns, self._label_key, fail) if self._label_key else None
        return Row(index=index, prompt=prompt, label=label, columns=columns)


def positions(  # noqa: PLR0917 - the interface the task codes against, read as a formula
    seed: int, step: int, rank: int, ranks: int, count: int, rows: int, *, shuffle: bool = True
) -> list[int]:
    """The `count` row positions (each in [0, rows)) rank `rank` of `ranks` uses at step `step`.

    The positions form one stream, epoch after epoch: epoch e is a permutation of range(rows)
    seeded by mix(seed, e, PERMUTATION_STREAM) (the identity when `shuffle` is False). Step s,
    rank r takes the `count` entries of the stream from ((s * ranks) + r) * count on, so within
    a step the ranks' windows are disjoint and consecutive, and step s+1 goes on where step s
    ended. A window may cross into the next epoch. A pure function of its arguments: a resumed
    run sees the same positions. The last few permutations are cached (one of 1 M rows costs
    about 10 ms).
    """
    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks}: want 0 <= rank < ranks")
    if count < 0:
        raise ValueError(f"count must not be negative, not {count}")
    if rows < 1:
        raise ValueError(f"rows must be at least 1, not {rows}")
    start = (step * ranks + rank) * count
    if not shuffle:
        return [position % rows for position in range(start, start + count)]
    found: list[int] = []
    position, end = start, start + count
    while position < end:
        epoch, offset = divmod(position, rows)
        take = min(end - position, rows - offset)
        found.extend(_permutation(seed, epoch, rows)[offset : offset + take].tolist())
        position += take
    return found


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, rows: int) -> npt.NDArray[np.int64]:
    generator = np.random.Generator(np.random.PCG64(mix(seed, epoch, PERMUTATION_STREAM)))
    order = generator.permutation(rows).astype(np.int64, copy=False)
    order.flags.writeable = False  # shared by every caller through the cache
    return order


def _prompt(value: object) -> Prompt | None:
    """`value` as a prompt (a chat's messages keep their string fields: role, content, and any
    other, e.g. name; a field Arrow filled with None is dropped), or None if it is not one."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        return None
    chat = []
    for message in value:
        if not isinstance(message, dict):
            return None
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return None
        chat.append({str(k): v for k, v in message.items() if isinstance(v, str)})
    return chat


def _column(key: str) -> str:
    """The column a key reads: "reward_model.ground_truth" reads the column "reward_model"
    (verl's GSM8K files keep the answer there)."""
    return key.partition(".")[0]


def _nested(columns: dict[str, Any], key: str, fail: Callable[[str], ConfigError]) -> Any:
    """The value of a dotted key ("reward_model.ground_truth") in a row's columns."""
    column, _, rest = key.partition(".")
    value = columns[column]
    for part in rest.split(".") if rest else []:
        if not isinstance(value, dict) or part not in value:
            raise fail(f"no {part!r} in {column!r} for the key {key!r}: it is {short(value)}")
        value = value[part]
    return value


def _check_columns(rows: FileRows, where: str, *, prompt_key: str, label_key: str) -> None:
    if not rows.columns:  # an empty JSON lines file: no row to read columns from
        return
    for key, name in ((prompt_key, "prompt_key"), (_column(label_key), "label_key")):
        if key and key not in rows.columns:
            raise ConfigError(
                f"{where}: {rows.path}: no column {key!r} ({_sibling(where, name)}); "
                f"its columns are {', '.join(map(repr, rows.columns))}"
            )


def _sibling(where: str, key: str) -> str:
    """The key `key` beside `where`: engine.task.train_files -> engine.task.prompt_key."""
    parent = where.rpartition(".")[0]
    return f"{parent}.{key}" if parent else key
