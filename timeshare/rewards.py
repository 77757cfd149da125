"""Built-in reward functions, named in a config as `path = "timeshare.rewards"` and `name =
"exact_match"` or `name = "math"`. They run in the reward processes like any user's function
(task/reward_pool.py), their arguments bound by name: `completion` and `label`.

`math` compares answers with math-verify (the `math` extra): its parsing and comparison have
timeouts of their own, which use signal.alarm and so work on a main thread only; elsewhere
they are left off (the pool's deadline still holds).
"""

from __future__ import annotations

import threading
from typing import Any

# A GSM8K answer ends "#### 72": what follows the last marker is the answer.
GSM8K_MARKER = "####"


def exact_match(completion: str, label: Any) -> float:
    """1.0 when the completion, stripped, is the label as text, stripped; else 0.0."""
    return 1.0 if completion.strip() == str(label).strip() else 0.0


def math(completion: str, label: Any) -> float:
    """1.0 when the completion's final (or \\boxed{}) answer equals the label's, as math-verify
    compares them (numbers, fractions, expressions, sets); else 0.0.

    A GSM8K label ("... #### 72") counts by what follows its last "####". A label in which
    math-verify finds no answer is an error (ValueError naming it), never a silent 0: the data
    is wrong, not the completion.
    """
    try:
        from math_verify import parse, verify  # type: ignore[import-untyped]  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            "the built-in reward timeshare.rewards:math needs math-verify: "
            "pip install 'timeshare[math]'"
        ) from error
    on_main = threading.current_thread() is threading.main_thread()
    parse_timeout = 5 if on_main else None
    gold_text = str(label)
    if GSM8K_MARKER in gold_text:
        gold_text = gold_text.rpartition(GSM8K_MARKER)[2]
    gold_text = gold_text.strip()
    gold = parse(gold_text, parsing_timeout=parse_timeout)
    if not gold:
        gold = parse(f"${gold_text}$", parsing_timeout=parse_timeout)
    if not gold:
        raise ValueError(f"math: math-verify finds no answer in the label {label!r}")
    answer = parse(completion, parsing_timeout=parse_timeout)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=5 if on_main else None) else 0.0
