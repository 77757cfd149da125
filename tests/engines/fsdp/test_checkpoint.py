"""The FSDP checkpoint's commit rule on step directories as a crash leaves them: a step counts
only when every rank that writes it made its part durable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from timeshare.engines import step_dirs
from timeshare.engines.fsdp import checkpoint
from timeshare.errors import CheckpointError


def make_step(
    root: Path, step: int, ranks: int, written: list[int], *, metadata: bool = True
) -> Path:
    directory = checkpoint.step_dir(root, step)
    directory.mkdir(parents=True)
    (directory / checkpoint.RANKS_FILE).write_text(json.dumps({"ranks": ranks}))
    if metadata:
        (directory / checkpoint.METADATA).write_bytes(b"x")
    for rank in written:
        checkpoint.rank_file(directory, rank).write_bytes(b"x")
    return directory


def test_a_step_is_committed_only_with_metadata_and_every_ranks_file(tmp_path: Path) -> None:
    assert checkpoint.is_committed(make_step(tmp_path, 1, 2, [0, 1]))
    assert not checkpoint.is_committed(make_step(tmp_path, 2, 2, [0]))  # rank 1 died first
    assert not checkpoint.is_committed(make_step(tmp_path, 3, 2, [1]))
    assert not checkpoint.is_committed(make_step(tmp_path, 4, 2, [0, 1], metadata=False))
    # The rank count is what the step says, not the files there happen to be.
    assert not checkpoint.is_committed(make_step(tmp_path, 5, 3, [0, 1]))
    no_count = make_step(tmp_path, 6, 2, [0, 1])
    (no_count / checkpoint.RANKS_FILE).unlink()
    assert not checkpoint.is_committed(no_count)
    assert checkpoint.committed_step(tmp_path) == 1
    assert checkpoint.committed_step(tmp_path / "elsewhere") is None


def test_a_step_of_more_ranks_is_resumed_only_where_min_nodes_allows(tmp_path: Path) -> None:
    directory = make_step(tmp_path, 1, 4, [0, 1, 2, 3])
    assert checkpoint.check_ranks(directory, 4, fewer_allowed=False) == 4
    with pytest.raises(
        CheckpointError, match=r"written by 4 ranks; this job has 2: set \[cluster\] min_nodes"
    ):
        checkpoint.check_ranks(directory, 2, fewer_allowed=False)
    assert checkpoint.check_ranks(directory, 2, fewer_allowed=True) == 4  # resharded on load


def test_a_step_of_fewer_ranks_is_refused(tmp_path: Path) -> None:
    directory = make_step(tmp_path, 1, 2, [0, 1])
    with pytest.raises(CheckpointError, match=r"written by 2 ranks; this job has 4 .*not to more"):
        checkpoint.check_ranks(directory, 4, fewer_allowed=True)


def test_pruning_keeps_the_newest_committed_and_nothing_older_that_never_was(
    tmp_path: Path,
) -> None:
    for step in (1, 3, 5, 6):
        make_step(tmp_path, step, 2, [0, 1])
    make_step(tmp_path, 2, 2, [0])  # never committed, older than what is kept
    make_step(tmp_path, 4, 2, [0])  # never committed, among what is kept: left for a redo
    make_step(tmp_path, 7, 2, [0])  # being written: newer, kept
    step_dirs.prune(tmp_path, checkpoint.SUBDIR, checkpoint.is_committed)
    assert checkpoint.steps(tmp_path) == [3, 4, 5, 6, 7]
    assert checkpoint.committed_step(tmp_path) == 6
