"""`timeshare task check CONFIG`: the user's task, checked before anything starts.

The same checks run at `timeshare run` (a failure exits 2, naming what is wrong), so that a row
that does not tokenize or a reward that cannot be called stops the run before any engine starts,
not at step 37:

- every row of `train_files` and `val_files` loads, renders and tokenizes (a progress line on
  large files); the prompts' length percentiles; the overlong rows listed (`overlong = "error"`:
  a failure) or counted (`"drop"`);
- the stop set covers the model's EOS (its tokenizer's and generation config's);
- two rendered prompts, as the model reads them;
- the reward function called once with the first row's label as the completion and once with an
  empty completion, in its pool of processes: its signature binds, it returns a score (or None),
  and how long it took;
- the data's fingerprint (files, keys, tokenizer, template), which the run records beside its
  checkpoints: a resume over other data is refused unless `timeshare run --data-changed`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from timeshare.config import Config
from timeshare.errors import ConfigError
from timeshare.task import tokenizer as tokenizers
from timeshare.task.dataset import PromptRows
from timeshare.task.prompts import (
    PROMPT_LENGTHS,
    DatasetPrompts,
    PromptScan,
    data_fingerprint,
    prompt_text,
    scan,
)
from timeshare.task.reward_function import RewardCall
from timeshare.task.reward_pool import RewardPool
from timeshare.task.tokenizer import TaskTokenizer

DATA_RECORD = "data.json"  # beside the checkpoints: the fingerprint of the data they learnt from
SHOWN_PROMPTS = 2
PROGRESS_EVERY_S = 1.0


@dataclass
class TaskCheck:
    """What the check found: its report's lines, and the data's fingerprint."""

    lines: list[str] = field(default_factory=list)
    fingerprint: str = ""


def check_task(config: Config, *, out: TextIO | None = None) -> TaskCheck:
    """Every check above, for a `kind = "dataset"` task (a `ConfigError` for the first that
    fails); `out` gets the progress line of long scans."""
    task = config.engine.task
    if task.kind != "dataset":
        raise ConfigError('timeshare task check: engine.task.kind is not "dataset"')
    source = config.engine.tokenizer_source()
    if source is None:
        raise ConfigError(
            f"engine.trainer = {config.engine.trainer!r} trains no model: a dataset task needs "
            "a model's tokenizer"
        )
    tokenizer = tokenizers.load(source)
    found = TaskCheck()
    found.lines.append(f"tokenizer: {tokenizer.where} ({len(tokenizer)} tokens)")
    found.lines += stop_lines(tokenizer, task.stop_token_ids)
    train = PromptRows.open(task.train_files, prompt_key=task.prompt_key, label_key=task.label_key)
    with train:
        prompts = scanned(
            train, tokenizer, config, where="engine.task.train_files", found=found, out=out
        )
        found.lines += shown_prompts(prompts, tokenizer)
        found.lines += reward_lines(config, prompts)
        # (the scan computed it to keep the lengths under it: the files are not hashed again)
        found.fingerprint = prompts.fingerprint or data_fingerprint(train, tokenizer)
    if task.val_files:
        where = "engine.task.val_files"
        val = PromptRows.open(
            task.val_files, prompt_key=task.prompt_key, label_key=task.label_key, where=where
        )
        with val:
            scanned(val, tokenizer, config, where=where, found=found, out=out)
    found.lines.append(f"data fingerprint: {found.fingerprint}")
    return found


def stop_lines(tokenizer: TaskTokenizer, job: tuple[int, ...]) -> list[str]:
    """The stop set and where each of its tokens comes from; the model's EOS must be in it."""
    stops = tokenizer.stop_set(job)
    missing = [t for t in (*tokenizer.tokenizer_eos, *tokenizer.generation_eos) if t not in stops]
    if missing:  # (stop_set is their union: this holds unless that rule breaks)
        raise ConfigError(f"the stop set {list(stops)} leaves out the model's EOS {missing}")
    return [
        f"stop set: {list(stops)} (tokenizer EOS {list(tokenizer.tokenizer_eos)}, "
        f"generation config EOS {list(tokenizer.generation_eos)}, "
        f"engine.task.stop_token_ids {list(job)})"
    ]


def scanned(
    rows: PromptRows,
    tokenizer: TaskTokenizer,
    config: Config,
    *,
    where: str,
    found: TaskCheck,
    out: TextIO | None,
) -> DatasetPrompts:
    """Every row of `rows` tokenized, with its figures reported (`found`)."""
    task = config.engine.task
    started = time.monotonic()
    shown = [started]

    def progress(done: int) -> None:
        now = time.monotonic()
        if out is not None and now - shown[0] >= PROGRESS_EVERY_S:
            shown[0] = now
            out.write(f"\r{where}: {done}/{len(rows)} rows tokenized")
            out.flush()

    kept_in = config.log.run_dir(config.job.checkpoint_dir) / PROMPT_LENGTHS
    lengths: PromptScan = scan(
        rows, tokenizer, task.max_prompt_tokens, where=where, progress=progress, kept_in=kept_in
    )
    if out is not None and time.monotonic() - started >= PROGRESS_EVERY_S:
        out.write("\n")
    prompts = DatasetPrompts.of(rows, tokenizer, lengths, drop=task.overlong == "drop", where=where)
    spread = ", ".join(f"{k} {v}" for k, v in lengths.percentiles().items())
    found.lines.append(
        f"{where}: {len(rows)} rows in {time.monotonic() - started:.1f} s; prompt tokens {spread} "
        f"(max_prompt_tokens {task.max_prompt_tokens})"
    )
    if prompts.dropped:
        found.lines.append(
            f'{where}: {prompts.dropped} overlong rows dropped (overlong = "drop"): '
            + ", ".join(str(int(i)) for i in lengths.overlong[:10])
        )
    return prompts


def shown_prompts(prompts: DatasetPrompts, tokenizer: TaskTokenizer) -> list[str]:
    lines = []
    for row, ids in prompts.share(0, 1, SHOWN_PROMPTS):
        lines.append(f"prompt of row {row.index} ({len(ids)} tokens):")
        lines += [
            f"  | {line}" for line in tokenizer.decode(ids, skip_special_tokens=False).splitlines()
        ]
    return lines


def reward_lines(config: Config, prompts: DatasetPrompts) -> list[str]:
    """The reward called on the first row: its label as the completion, then an empty one."""
    task = config.engine.task
    assert task.reward is not None, "a dataset task has a reward (TaskSpec's check)"
    ((row, _),) = prompts.share(0, 1, 1)
    text = prompt_text(row, prompts.tokenizer)
    tries = {
        "the label": "" if row.label is None else str(row.label),
        "an empty completion": "",
    }
    calls = [
        RewardCall(
            sample_id=f"check-{n}",
            row_index=row.index,
            completion=completion,
            prompt=text,
            label=row.label,
            row=row.columns,
            finish_reason="stop",
        )
        for n, completion in enumerate(tries.values())
    ]
    lines = []
    with RewardPool(task.reward, base_dir=Path(), columns=row.columns) as pool:
        outcomes = pool.score(calls)
    for what, outcome in zip(tries, outcomes, strict=True):
        if outcome.error is not None:
            raise ConfigError(
                f"engine.task.reward: {task.reward.where} failed on row {row.index} with "
                f"{what} as the completion: {outcome.error.strip()}"
            )
        extras = f", extras {json.dumps(outcome.extras)}" if outcome.extras else ""
        lines.append(
            f"reward {task.reward.where} on row {row.index} with {what}: "
            f"{outcome.score!r}{extras} in {outcome.seconds * 1e3:.1f} ms"
        )
    return lines


def checked_data(config: Config, fingerprint: str, *, data_changed: bool) -> None:
    """The run's data against what its checkpoints learnt from (`DATA_RECORD`): other data is
    refused by name unless `data_changed`; the record is then (re)written."""
    root = Path(config.job.checkpoint_dir)
    record = root / DATA_RECORD
    checkpoints = root.is_dir() and any(p.name != DATA_RECORD for p in root.iterdir())
    if record.exists() and checkpoints:
        try:
            before = json.loads(record.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{record} cannot be read: {exc}") from exc
        if before.get("fingerprint") != fingerprint and not data_changed:
            raise ConfigError(
                f"the data of this run (fingerprint {fingerprint}: engine.task.train_files "
                f"{list(config.engine.task.train_files)}, prompt_key, label_key, tokenizer, "
                f"template) differ from those the checkpoints in {root} learnt from "
                f"(fingerprint {before.get('fingerprint')}, files {before.get('files')}): a "
                "resume would see other prompts than it would have seen; run with "
                "--data-changed to go on anyway"
            )
    root.mkdir(parents=True, exist_ok=True)
    record.write_text(
        json.dumps(
            {"fingerprint": fingerprint, "files": list(config.engine.task.train_files)}, indent=1
        )
        + "\n"
    )
