"""A dataset's prompts, as a job uses them: every row tokenized once, the overlong ones found,
and which rows each rank prompts with at each step.

`scan` reads every row through the job's tokenizer (a row that does not render or tokenize is a
`ConfigError` naming it) and records each prompt's length in a numpy array: memory grows by four
bytes a row, never by a row's Python objects. Tokenizing runs at about 10,000 rows a second
here (a chat template rendered, then encoded), so the lengths are kept in the run's directory
under the data's fingerprint: the check `timeshare run` makes scans a large file once, and every
rollout worker then reads the lengths instead of scanning again.

`DatasetPrompts` then keeps the rows a job may use (all of them, or, with `overlong = "drop"`,
those that fit `max_prompt_tokens`) and gives rank r of step s the rows at
`positions(seed, s, r, ...)` of them: a pure function of (seed, step, rank), so a run resumed at
step k sees exactly the prompts it would have seen.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash

from timeshare.durable import write_atomically
from timeshare.errors import ConfigError
from timeshare.task.dataset import PromptRows, Row, positions
from timeshare.task.tokenizer import TaskTokenizer

SHOWN_ROWS = 10  # overlong rows an error lists (then how many more)
FINGERPRINT_ROWS = 8  # rows whose ids stand for the tokenizer in the data's fingerprint
PROMPT_LENGTHS = "prompt_lengths"  # in the run's directory: <data fingerprint>.npy


@dataclass(frozen=True)
class PromptScan:
    """Every row's prompt length in tokens, and the rows longer than the job allows."""

    lengths: npt.NDArray[np.int32]
    max_prompt_tokens: int
    fingerprint: str = ""  # the data's (data_fingerprint), where the scan computed it

    @property
    def overlong(self) -> npt.NDArray[np.int64]:
        return np.flatnonzero(self.lengths > self.max_prompt_tokens)

    def percentiles(self) -> dict[str, int]:
        """p50, p90, p99 and max of the prompts' lengths."""
        if not len(self.lengths):
            return {}
        points = {"p50": 50, "p90": 90, "p99": 99, "max": 100}
        return {
            name: int(np.percentile(self.lengths, q, method="higher")) for name, q in points.items()
        }

    def overlong_message(self, where: str) -> str:
        """The overlong rows, the first `SHOWN_ROWS` by index and length."""
        rows = self.overlong
        shown = ", ".join(f"row {i} ({self.lengths[i]} tokens)" for i in rows[:SHOWN_ROWS])
        more = f" and {len(rows) - SHOWN_ROWS} more" if len(rows) > SHOWN_ROWS else ""
        return (
            f"{where}: {len(rows)} of {len(self.lengths)} prompts are longer than "
            f"engine.task.max_prompt_tokens ({self.max_prompt_tokens}): {shown}{more}; raise "
            'the limit, or set engine.task.overlong = "drop" to leave them out'
        )


def prompt_of(row: Row, tokenizer: TaskTokenizer, where: str) -> tuple[int, ...]:
    """A row's prompt ids (the tokenizer's rule: a chat rendered, a string encoded)."""
    try:
        return tokenizer.prompt_ids(row.prompt)
    except ConfigError as exc:
        raise ConfigError(f"{where}: row {row.index}: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"{where}: row {row.index} does not render or tokenize: {type(exc).__name__}: {exc}"
        ) from exc


def prompt_text(row: Row, tokenizer: TaskTokenizer) -> str:
    """A row's prompt as text, for a reward function: the string, or the chat rendered."""
    return row.prompt if isinstance(row.prompt, str) else tokenizer.render(row.prompt)


def scan(
    rows: PromptRows,
    tokenizer: TaskTokenizer,
    max_prompt_tokens: int,
    *,
    where: str,
    progress: Callable[[int], None] | None = None,
    kept_in: Path | None = None,
) -> PromptScan:
    """Every row read, rendered and tokenized once; `progress(rows done)` now and then.
    `kept_in`: a directory where the lengths are kept under the data's fingerprint (read from
    there when an earlier scan of the same data left them)."""
    fingerprint = "" if kept_in is None else data_fingerprint(rows, tokenizer)
    kept = None if kept_in is None else kept_in / f"{fingerprint}.npy"
    if kept is not None and (lengths := _kept_lengths(kept, len(rows))) is not None:
        return PromptScan(lengths, max_prompt_tokens, fingerprint)
    lengths = _lengths(rows, tokenizer, where, progress)
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, lengths)
        write_atomically(kept, buffer.getvalue())
    return PromptScan(lengths, max_prompt_tokens, fingerprint)


def _kept_lengths(path: Path, rows: int) -> npt.NDArray[np.int32] | None:
    """The lengths an earlier scan kept at `path` (None: none, or not of `rows` rows)."""
    try:
        lengths = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if not isinstance(lengths, np.ndarray) or lengths.shape != (rows,):
        return None
    if lengths.dtype != np.int32:
        return None
    kept: npt.NDArray[np.int32] = lengths
    return kept


def _lengths(
    rows: PromptRows,
    tokenizer: TaskTokenizer,
    where: str,
    progress: Callable[[int], None] | None,
) -> npt.NDArray[np.int32]:
    lengths = np.zeros(len(rows), dtype=np.int32)
    for done, row in enumerate(rows.iter_rows()):
        lengths[row.index] = len(prompt_of(row, tokenizer, where))
        if progress is not None and done % 1024 == 1023:
            progress(done + 1)
    if progress is not None:
        progress(len(rows))
    return lengths


@dataclass(frozen=True)
class DatasetPrompts:
    """The rows a job prompts with, and which of them rank r uses at step s."""

    rows: PromptRows
    tokenizer: TaskTokenizer
    kept: npt.NDArray[np.int64]  # the rows in use, by index (overlong ones dropped or none)
    dropped: int
    where: str
    fingerprint: str = ""  # the scan's (PromptScan.fingerprint)

    @classmethod
    def of(
        cls,
        rows: PromptRows,
        tokenizer: TaskTokenizer,
        found: PromptScan,
        *,
        drop: bool,
        where: str,
    ) -> DatasetPrompts:
        """The rows of `found` in use: an overlong row is an error unless `drop`."""
        overlong = found.overlong
        if len(overlong) and not drop:
            raise ConfigError(found.overlong_message(where))
        kept = np.flatnonzero(found.lengths <= found.max_prompt_tokens)
        if not len(kept):
            raise ConfigError(f"{where}: no prompt fits engine.task.max_prompt_tokens")
        return cls(rows, tokenizer, kept, len(overlong), where, found.fingerprint)

    def __len__(self) -> int:
        return len(self.kept)

    def step_rows(
        self, seed: int, step: int, rank: int, ranks: int, count: int, *, shuffle: bool
    ) -> list[tuple[Row, tuple[int, ...]]]:
        """Rank `rank`'s `count` rows of step `step`, with their prompt ids."""
        at = positions(seed, step, rank, ranks, count, len(self.kept), shuffle=shuffle)
        return self.with_ids(self.rows.rows([int(self.kept[p]) for p in at]))

    def share(self, rank: int, ranks: int, limit: int) -> list[tuple[Row, tuple[int, ...]]]:
        """Rank `rank`'s share of the rows in order (validation): every `ranks`-th row from
        its own, of the first `limit` (0: all)."""
        end = len(self.kept) if limit == 0 else min(limit, len(self.kept))
        return self.with_ids(self.rows.rows([int(i) for i in self.kept[rank:end:ranks]]))

    def with_ids(self, rows: Sequence[Row]) -> list[tuple[Row, tuple[int, ...]]]:
        return [(row, prompt_of(row, self.tokenizer, self.where)) for row in rows]


def data_fingerprint(rows: PromptRows, tokenizer: TaskTokenizer) -> str:
    """What the prompts of a run are made of: the files and keys (`rows.fingerprint()`), the
    chat template, and the tokenizer: its whole definition where it is a fast tokenizer (the
    `tokenizers` library's JSON), and the ids it gives the first rows."""
    digest = xxhash.xxh3_128()
    digest.update(rows.fingerprint().encode())
    digest.update(str(tokenizer.tokenizer.chat_template or "").encode())
    digest.update(str(len(tokenizer)).encode())
    backend = getattr(tokenizer.tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(str(backend.to_str()).encode())
    for row in rows.rows(range(min(FINGERPRINT_ROWS, len(rows)))):
        digest.update(repr(tokenizer.prompt_ids(row.prompt)).encode())
    return digest.hexdigest()
