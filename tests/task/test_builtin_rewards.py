"""The built-in rewards (timeshare/rewards.py): exact_match, and math compared by math-verify."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

from timeshare import rewards

GSM8K_LABEL = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


@pytest.mark.parametrize(
    ("completion", "label", "score"),
    [
        ("42", "42", 1.0),
        ("  42\n", 42, 1.0),
        ("42", " 42 ", 1.0),
        ("41", "42", 0.0),
        ("The answer is 42", "42", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(completion: str, label: Any, score: float) -> None:
    assert rewards.exact_match(completion, label) == score


@pytest.mark.parametrize(
    ("completion", "label", "score"),
    [
        ("\\boxed{4}", "4", 1.0),
        ("so the result is \\boxed{4}.", 4, 1.0),
        ("The answer is 72", "#### 72", 1.0),
        ("The answer is 72", GSM8K_LABEL, 1.0),
        ("She sold 1,000 clips: \\boxed{1000}", "#### 1,000", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is 73", "#### 72", 0.0),
        ("\\boxed{5}", "4", 0.0),
        ("I do not know", "4", 0.0),
        ("", "4", 0.0),
    ],
)
def test_math_compares_the_final_answer(completion: str, label: Any, score: float) -> None:
    assert rewards.math(completion, label) == score


def test_math_refuses_a_label_without_an_answer() -> None:
    with pytest.raises(ValueError, match="no answer in the label ''"):
        rewards.math("\\boxed{4}", "")


def test_math_works_off_the_main_thread_too() -> None:
    scores: list[float] = []
    thread = threading.Thread(target=lambda: scores.append(rewards.math("\\boxed{4}", "4")))
    thread.start()
    thread.join(timeout=30)
    assert scores == [1.0]


def test_math_without_math_verify_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # an import of it now fails
    with pytest.raises(ImportError, match=r"pip install 'timeshare\[math\]'"):
        rewards.math("\\boxed{4}", "4")
