"""One file of a prompt dataset, read by row: parquet, JSON lines, or one JSON array.

What each format keeps in memory, so that memory does not grow with the file:

- parquet: the open `ParquetFile` and its row groups' row counts; a read decodes only the row
  groups that hold the requested rows (all columns: a row's every column is wanted), keeps the
  last `CACHED_ROW_GROUPS` of them as Arrow tables (Arrow memory, never Python objects) and turns
  just the requested rows into Python values. A row group is the smallest unit parquet can
  decode, so a file written as one huge row group costs that row group's Arrow memory.
- JSON lines: a numpy int64 array of line offsets (8 bytes a row), built once by scanning the
  file in chunks; a row is read by seek. Empty lines are skipped (they are not rows).
- JSON (one array of objects): read whole, so for small files only.

pyarrow is imported when a parquet file is opened, not with this module: a config's checks may
import the task package, and must stay quick.

Not thread-safe: a reader seeks one shared handle.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from timeshare.errors import ConfigError

CACHED_ROW_GROUPS = 2
SCAN_CHUNK = 16 * 2**20  # bytes read at a time while indexing JSON lines
SUFFIXES = (".parquet", ".jsonl", ".json")


class FileRows(Protocol):
    """The rows of one file, numbered from 0 within it."""

    path: Path
    columns: tuple[str, ...]  # the file's columns (JSON lines: its first row's keys)

    def __len__(self) -> int: ...

    def read(self, local: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at `local` (each in range), in that order."""
        ...

    def iterate(self, batch_rows: int) -> Iterator[dict[str, Any]]:
        """Every row in order, `batch_rows` at most decoded at a time."""
        ...

    def place(self, local: int) -> str:
        """Where row `local` is in the file, for errors: "row 5", "line 7"."""
        ...

    def close(self) -> None: ...


def open_file(path: Path, where: str) -> FileRows:
    """The rows of `path`, by its extension; ConfigError naming `where` and the file for a
    missing file, an unknown extension or a file that cannot be read."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"{where}: {path}: unknown extension {path.suffix!r}; want one of {', '.join(SUFFIXES)}"
        )
    if not path.is_file():
        raise ConfigError(f"{where}: {path}: no such file")
    if suffix == ".parquet":
        return ParquetRows(path, where)
    if suffix == ".jsonl":
        return JsonLinesRows(path, where)
    return JsonRows(path, where)


def to_jsonlike(value: Any) -> Any:
    """`value` as str, int, float, bool, None, list and dict alone: Arrow's Python values
    include bytes, datetimes, decimals and (for maps) tuples; numpy's scalars have `.item()`."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(key): to_jsonlike(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonlike(item) for item in value]
    return _scalar(value)


def _scalar(value: object) -> Any:
    if isinstance(value, np.generic):
        return to_jsonlike(value.item())
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, datetime.date | datetime.time):  # a datetime is a date
        return value.isoformat()
    return str(value)  # a timedelta, an unknown extension type's value


class ParquetRows:
    """A parquet file, decoded by row group on demand."""

    def __init__(self, path: Path, where: str) -> None:
        import pyarrow.parquet as pq  # noqa: PLC0415 - see above

        self.path = path
        self._where = where
        try:
            self._file: Any = pq.ParquetFile(str(path))
        except Exception as error:  # pyarrow's ArrowInvalid, OSError: the file is not parquet
            raise ConfigError(f"{where}: {path}: not a readable parquet file: {error}") from error
        try:
            metadata = self._file.metadata
            counts = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
            self.columns = tuple(str(name) for name in self._file.schema_arrow.names)
        except BaseException:
            self._file.close()
            raise
        self._ends: npt.NDArray[np.int64] = np.cumsum(np.asarray(counts, dtype=np.int64))
        self._groups: OrderedDict[int, Any] = OrderedDict()  # row group -> decoded Arrow table

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def read(self, local: Sequence[int]) -> list[dict[str, Any]]:
        wanted = np.asarray(local, dtype=np.int64)
        groups = np.searchsorted(self._ends, wanted, side="right")
        found: dict[int, dict[str, Any]] = {}
        for group in np.unique(groups).tolist():
            table = self._row_group(group)
            first = int(self._ends[group - 1]) if group else 0
            rows = np.unique(wanted[groups == group])
            values = table.take((rows - first).tolist()).to_pylist()
            found.update(zip(rows.tolist(), values, strict=True))
        return [{key: to_jsonlike(v) for key, v in found[i].items()} for i in wanted.tolist()]

    def _row_group(self, group: int) -> Any:
        table = self._groups.get(group)
        if table is not None:
            self._groups.move_to_end(group)
            return table
        try:
            table = self._file.read_row_group(group)
        except Exception as error:  # a corrupt page or column chunk
            raise ConfigError(
                f"{self._where}: {self.path}: row group {group} cannot be read: {error}"
            ) from error
        self._groups[group] = table
        while len(self._groups) > CACHED_ROW_GROUPS:
            self._groups.popitem(last=False)
        return table

    def iterate(self, batch_rows: int) -> Iterator[dict[str, Any]]:
        import pyarrow.parquet as pq  # noqa: PLC0415 - see the module's docstring

        # A file of its own: a caller may read rows by index between two batches.
        reader = pq.ParquetFile(str(self.path))
        try:
            for batch in reader.iter_batches(batch_size=batch_rows):
                for row in batch.to_pylist():
                    yield {key: to_jsonlike(value) for key, value in row.items()}
        finally:
            reader.close()

    def place(self, local: int) -> str:
        return f"row {local}"

    def close(self) -> None:
        self._groups.clear()
        self._file.close()


class JsonLinesRows:
    """A JSON lines file: one object a line, read by seek through an index of line offsets."""

    def __init__(self, path: Path, where: str) -> None:
        self.path = path
        self._where = where
        self._handle = path.open("rb")
        try:
            self._starts = self._index()
            self.columns: tuple[str, ...] = tuple(self.read([0])[0]) if len(self._starts) else ()
        except BaseException:
            self._handle.close()
            raise

    def _index(self) -> npt.NDArray[np.int64]:
        """The offset of every non-empty line (8 bytes a row: no line is kept)."""
        newlines: list[npt.NDArray[np.int64]] = []
        offset = 0
        while chunk := self._handle.read(SCAN_CHUNK):
            found = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == ord("\n"))
            newlines.append(found.astype(np.int64) + offset)
            offset += len(chunk)
        ends = np.concatenate([*newlines, np.asarray([offset], dtype=np.int64)])
        starts = np.concatenate([np.asarray([0], dtype=np.int64), ends[:-1] + 1])
        lengths = ends - starts
        keep = lengths > 0
        for single in np.flatnonzero(lengths == 1).tolist():  # a lone "\r" is empty too
            keep[single] = os.pread(self._handle.fileno(), 1, int(starts[single])) != b"\r"
        return np.ascontiguousarray(starts[keep])

    def __len__(self) -> int:
        return len(self._starts)

    def read(self, local: Sequence[int]) -> list[dict[str, Any]]:
        rows = []
        for index in local:
            self._handle.seek(int(self._starts[index]))
            rows.append(self._parse(self._handle.readline(), functools.partial(self.place, index)))
        return rows

    def _parse(self, line: bytes, place: Callable[[], str]) -> dict[str, Any]:
        try:
            value = json.loads(line)
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            raise ConfigError(
                f"{self._where}: {self.path}: {place()} is not JSON: {error}"
            ) from error
        if not isinstance(value, dict):
            raise ConfigError(
                f"{self._where}: {self.path}: {place()} is not a JSON object "
                f"but {type(value).__name__} {short(value)}"
            )
        return value

    def iterate(self, batch_rows: int) -> Iterator[dict[str, Any]]:
        with self.path.open("rb") as handle:  # its own: rows may be read by index meanwhile
            for number, line in enumerate(handle, start=1):
                if line.rstrip(b"\n") not in (b"", b"\r"):
                    yield self._parse(line, functools.partial(_line, number))

    def place(self, local: int) -> str:
        """The line number of row `local` (counted on demand: errors only)."""
        start = int(self._starts[local])
        newlines = 0
        with self.path.open("rb") as handle:
            while start > 0 and (chunk := handle.read(min(SCAN_CHUNK, start))):
                newlines += chunk.count(b"\n")
                start -= len(chunk)
        return f"line {newlines + 1}"

    def close(self) -> None:
        self._handle.close()


class JsonRows:
    """A JSON file holding one array of objects, read whole: for small files only."""

    def __init__(self, path: Path, where: str) -> None:
        self.path = path
        try:
            with path.open("rb") as handle:
                value = json.load(handle)
        except ValueError as error:
            raise ConfigError(f"{where}: {path}: not JSON: {error}") from error
        if not isinstance(value, list):
            raise ConfigError(
                f"{where}: {path}: want one JSON array of objects, not {type(value).__name__}"
            )
        for number, item in enumerate(value):
            if not isinstance(item, dict):
                raise ConfigError(
                    f"{where}: {path}: element {number} is not a JSON object but "
                    f"{type(item).__name__} {short(item)}"
                )
        self._rows: list[dict[str, Any]] = value
        self.columns: tuple[str, ...] = tuple(value[0]) if value else ()

    def __len__(self) -> int:
        return len(self._rows)

    def read(self, local: Sequence[int]) -> list[dict[str, Any]]:
        return [dict(self._rows[index]) for index in local]  # a caller's to change

    def iterate(self, batch_rows: int) -> Iterator[dict[str, Any]]:
        yield from self._rows

    def place(self, local: int) -> str:
        return f"element {local}"

    def close(self) -> None:
        self._rows = []


def _line(number: int) -> str:
    return f"line {number}"


def short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
