"""The reward function itself (timeshare/task/reward_function.py), in this process: loading it,
binding its arguments by name (verl's names too), checking what it returned."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from timeshare.errors import ConfigError, RewardFunctionError
from timeshare.task.reward_function import (
    RewardCall,
    RewardOutcome,
    RewardSpec,
    bind,
    call_function,
    check_signature,
    checked_result,
    load_function,
)

WHERE = "rewards.py:compute_score"


def a_call(**fields: Any) -> RewardCall:
    values: dict[str, Any] = {
        "sample_id": "s0",
        "row_index": 3,
        "completion": " 42 ",
        "prompt": "What is 6*7?",
        "label": "42",
        "row": {"question": "What is 6*7?", "answer": "42"},
        "finish_reason": "stop",
        "completion_ids": [5, 6],
        "step": 7,
    }
    return RewardCall(**(values | fields))


# -- the spec --------------------------------------------------------------------------------------


def test_the_spec_has_defaults_names_its_function_and_refuses_what_it_does_not_know() -> None:
    spec = msgspec.convert({"path": "rewards.py"}, RewardSpec)
    assert (spec.name, spec.timeout_s, spec.on_error, spec.processes) == (
        "compute_score",
        10.0,
        "fail",
        2,
    )
    assert spec.where == WHERE
    with pytest.raises(msgspec.ValidationError, match="timeout"):
        msgspec.convert({"path": "r.py", "timeout": 3}, RewardSpec)
    with pytest.raises(msgspec.ValidationError, match="timeout_s"):
        msgspec.convert({"path": "r.py", "timeout_s": 0}, RewardSpec)
    with pytest.raises(msgspec.ValidationError, match="on_error"):
        msgspec.convert({"path": "r.py", "on_error": "zero"}, RewardSpec)


def test_calls_and_outcomes_travel_as_msgpack() -> None:
    call = a_call(row={"nested": {"a": [1, 2.5, None]}})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(call), type=RewardCall) == call
    outcome = RewardOutcome(score=0.5, extras={"acc": 1.0}, seconds=0.1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(outcome), type=RewardOutcome) == outcome


# -- binding ---------------------------------------------------------------------------------------


def test_arguments_are_bound_by_name_from_the_sample_and_its_row() -> None:
    def compute_score(completion: str, label: str, question: str, step: int) -> float:
        return 0.0

    assert bind(compute_score, a_call()) == {
        "completion": " 42 ",
        "label": "42",
        "question": "What is 6*7?",
        "step": 7,
    }


def test_verl_names_bind_as_verl_passes_them() -> None:
    def compute_score(
        data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
    ) -> float:
        return 0.0

    assert bind(compute_score, a_call()) == {
        "data_source": "",
        "solution_str": " 42 ",
        "ground_truth": "42",
        "extra_info": None,
    }
    row = {"data_source": "openai/gsm8k", "extra_info": {"index": 9}}
    assert bind(compute_score, a_call(row=row)) == {
        "data_source": "openai/gsm8k",
        "solution_str": " 42 ",
        "ground_truth": "42",
        "extra_info": {"index": 9},
    }


def test_the_sample_s_own_names_win_over_row_columns_of_the_same_name() -> None:
    def compute_score(prompt: str, label: str, completion: str) -> float:
        return 0.0

    row = {"prompt": "the raw column", "label": "a column", "completion": "x"}
    assert bind(compute_score, a_call(row=row)) == {
        "prompt": "What is 6*7?",
        "label": "42",
        "completion": " 42 ",
    }


def test_defaults_stay_and_var_keyword_receives_everything_else() -> None:
    def compute_score(completion: str, scale: float = 2.0, **kwargs: Any) -> float:
        return 0.0

    bound = bind(compute_score, a_call())
    assert "scale" not in bound
    assert bound["completion"] == " 42 "
    assert {"prompt", "label", "question", "answer", "solution_str", "step"} <= set(bound)


def test_positional_only_parameters_are_passed_positionally() -> None:
    def compute_score(completion: str, label: str, /, *, step: int) -> tuple[str, str, int]:
        return completion, label, step

    assert call_function(compute_score, a_call()) == (" 42 ", "42", 7)


def test_a_required_parameter_nothing_supplies_is_an_error_naming_it() -> None:
    def compute_score(completion: str, reference: str) -> float:
        return 0.0

    with pytest.raises(RewardFunctionError, match=r"'reference'.*names available: .*question"):
        bind(compute_score, a_call())


def test_the_signature_is_checked_against_the_dataset_s_columns() -> None:
    def compute_score(completion: str, reference: str, scale: float = 1.0, **kw: Any) -> float:
        return 0.0

    check_signature(compute_score, WHERE, ["question", "reference"])
    with pytest.raises(ConfigError) as caught:
        check_signature(compute_score, WHERE, ["question"])
    said = str(caught.value)
    assert WHERE in said and "'reference'" in said and "question" in said and "label" in said


def test_an_async_function_is_run_to_its_end() -> None:
    async def compute_score(completion: str) -> float:
        return float(completion.strip())

    assert call_function(compute_score, a_call()) == 42.0


# -- results ---------------------------------------------------------------------------------------


def test_numbers_dicts_and_none_are_rewards() -> None:
    assert checked_result(1, WHERE) == (1.0, {})
    assert checked_result(0.25, WHERE) == (0.25, {})
    assert checked_result(True, WHERE) == (1.0, {})
    assert checked_result(False, WHERE) == (0.0, {})
    assert checked_result(None, WHERE) == (None, {})
    assert checked_result({"score": 0.5, "acc": True, "length": 12}, WHERE) == (
        0.5,
        {"acc": 1.0, "length": 12.0},
    )
    assert checked_result({"score": None}, WHERE) == (None, {})


def test_an_extra_that_is_no_number_is_no_figure() -> None:
    """verl's DAPO reward returns its parsed answer as "pred": the file runs, the text is left
    out of the step's figures."""
    assert checked_result({"score": 1.0, "pred": "72", "acc": 1}, WHERE) == (1.0, {"acc": 1.0})


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (math.nan, "nan"),
        (math.inf, "inf"),
        ("1.0", "str"),
        ([1.0], "list"),
        ({"acc": 1.0}, 'without "score"'),
        ({"score": "1"}, "str"),
        ({"score": 1.0, "ratio": math.nan}, "'ratio' nan"),
    ],
)
def test_what_is_not_a_reward_is_an_error_naming_the_function(value: Any, said: str) -> None:
    with pytest.raises(RewardFunctionError) as caught:
        checked_result(value, WHERE)
    assert WHERE in str(caught.value)
    assert said in str(caught.value)


# -- loading ---------------------------------------------------------------------------------------


def test_a_file_is_loaded_relative_to_its_base_directory(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text("def compute_score(completion):\n    return 1.0\n")
    function = load_function("rewards.py", "compute_score", base_dir=tmp_path)
    assert function("x") == 1.0
    assert load_function(str(tmp_path / "rewards.py"), "compute_score")("y") == 1.0


def test_a_dotted_module_is_imported() -> None:
    function = load_function("timeshare.rewards", "exact_match")
    assert function(completion=" 4", label=4) == 1.0


@pytest.mark.parametrize(
    ("source", "name", "said"),
    [
        (None, "compute_score", "does not exist"),
        ("def score(completion):\n    return 1\n", "compute_score", "no 'compute_score'.*score"),
        ("compute_score = 3\n", "compute_score", "is a int, not a function"),
        ("raise RuntimeError('no GPU here')\n", "compute_score", "RuntimeError: no GPU here"),
        ("def compute_score(:\n", "compute_score", "SyntaxError"),
    ],
)
def test_loading_failures_are_config_errors_naming_the_function(
    tmp_path: Path, source: str | None, name: str, said: str
) -> None:
    if source is not None:
        (tmp_path / "rewards.py").write_text(source)
    with pytest.raises(ConfigError, match=said) as caught:
        load_function("rewards.py", name, base_dir=tmp_path)
    assert f"rewards.py:{name}" in str(caught.value)


def test_a_missing_module_is_named() -> None:
    with pytest.raises(ConfigError, match=r"no_such_pkg\.rewards:compute_score: no module named"):
        load_function("no_such_pkg.rewards", "compute_score")
    with pytest.raises(ConfigError, match=r"a \.py file or a dotted module"):
        load_function("rewards-v2", "compute_score")
