"""An engine's config check in a child process (engines/child_check.py): a check that passed is
remembered under a key of all it can read, a rejection is checked and said every time."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from timeshare.engines import child_check
from timeshare.engines.child_check import ask_child
from timeshare.errors import ConfigError

MODULE = "tests.engines.counted_check"


@pytest.fixture(autouse=True)
def checks_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "checks"
    monkeypatch.setattr(child_check, "CHECKS_DIR", directory)
    return directory


def ask(payload: Mapping[str, object]) -> None:
    ask_child(MODULE, json.dumps(payload), "engine.fake: its check", 60.0)


def runs(tmp_path: Path) -> int:
    file = tmp_path / "runs"
    return len(file.read_text().splitlines()) if file.exists() else 0


def test_a_check_that_passed_is_not_run_again_for_the_same_question(
    tmp_path: Path, checks_dir: Path
) -> None:
    ask({"runs": str(tmp_path / "runs"), "key": 1})
    ask({"runs": str(tmp_path / "runs"), "key": 1})
    assert runs(tmp_path) == 1
    assert [p.read_text() for p in checks_dir.iterdir()] == ["ok\n"]
    ask({"runs": str(tmp_path / "runs"), "key": 2})  # another question: asked
    assert runs(tmp_path) == 2


def test_a_rejection_is_checked_and_said_every_time(tmp_path: Path, checks_dir: Path) -> None:
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"^engine\.fake\.key: rejected$"):
            ask({"runs": str(tmp_path / "runs"), "fail": True})
    assert runs(tmp_path) == 2
    assert not checks_dir.exists() or list(checks_dir.iterdir()) == []


def test_a_changed_file_in_a_directory_the_question_names_asks_again(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    question = {"runs": str(tmp_path / "runs"), "model_dir": str(model)}
    ask(question)
    ask(question)
    assert runs(tmp_path) == 1
    (model / "config.json").write_text('{"hidden_size": 8}')  # (its size changes)
    ask(question)
    assert runs(tmp_path) == 2


def test_a_check_that_cannot_answer_says_why_and_is_not_remembered(
    tmp_path: Path, checks_dir: Path
) -> None:
    with pytest.raises(ConfigError, match=r"engine\.fake: its check: could not be checked"):
        ask_child("tests.engines.no_such_module", "{}", "engine.fake: its check", 60.0)
    assert not checks_dir.exists() or list(checks_dir.iterdir()) == []
