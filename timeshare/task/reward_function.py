"""The user's reward function: its spec, loading it, binding its arguments by name, checking
what it returned.

A reward function is named by `[engine.task.reward]`: a `.py` file or a dotted module, and a
name in it. Its arguments are bound by parameter name from what a sample has (`completion`,
`prompt`, `label`, every column of the dataset row, `finish_reason`, `completion_ids`, `step`),
and from verl's names as well (`data_source`, `solution_str`, `ground_truth`, `extra_info`), so
that a verl reward file loads unchanged. Whatever it returns is checked here, once: a number,
a dict with a numeric "score" (its other numbers are extras), or None to skip the sample.
Anything else (NaN, a string, a list) is an error naming the function, never a silent 0.

The function runs in processes of its own (reward_child.py, reward_pool.py): a hanging reward
is killed at its deadline, one that crashes its process costs only that sample, and it runs on
its process's main thread (math-verify's timeouts use signal.alarm, which needs one).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from timeshare.errors import ConfigError, RewardFunctionError

# The names a sample supplies whatever its row holds; they take precedence over row columns of
# the same name.
EXPLICIT_NAMES = ("completion", "prompt", "label", "finish_reason", "completion_ids", "step")
# verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None)`.
VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")
DOTTED_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# A value shown in an error message is cut to this many characters.
SHOWN_CHARS = 200


class RewardSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[engine.task.reward]`: which function scores a completion, and how failures are taken.

    `on_error` and `max_skipped_fraction` are the caller's policy (the pool reports every
    outcome as it is): "fail" stops at a sample whose reward failed, "skip" drops it, up to
    `max_skipped_fraction` of a batch.
    """

    path: str  # a .py file (relative paths resolved by the caller) or a dotted module
    name: str = "compute_score"
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    on_error: Literal["fail", "skip"] = "fail"
    processes: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    max_skipped_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05

    @property
    def where(self) -> str:
        """The function as the user wrote it, e.g. "rewards.py:compute_score": every error
        message names it."""
        return f"{self.path}:{self.name}"


class RewardCall(msgspec.Struct, frozen=True, kw_only=True):
    """One sample to score; travels to a reward process as msgpack."""

    sample_id: str
    row_index: int
    completion: str  # decoded completion text (no EOS)
    prompt: str  # the prompt's text as the row gives it (a chat: its rendered text)
    label: Any = None
    row: dict[str, Any] = {}  # every column of the dataset row (JSON-like values)
    finish_reason: str = "length"
    completion_ids: list[int] = []
    step: int = 0


class RewardOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What scoring one sample gave. `score` is None when the function returned None (skip: no
    error) or when it failed (`error` says how: a traceback, a deadline, a dead process, a bad
    return value); a failure never reads as a score of 0."""

    score: float | None
    extras: dict[str, float] = {}
    error: str | None = None
    seconds: float = 0.0


# -- loading ---------------------------------------------------------------------------------------


def is_file_path(path: str) -> bool:
    """Whether `path` names a .py file (else a dotted module)."""
    return path.endswith(".py") or "/" in path


def resolve_file(path: str, base_dir: Path | None) -> Path:
    """The file `path` names, a relative one taken from `base_dir` (the working directory
    without one)."""
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = (base_dir if base_dir is not None else Path.cwd()) / file
    return file


def load_function(path: str, name: str, *, base_dir: Path | None = None) -> Callable[..., Any]:
    """The callable `name` of the file or dotted module `path`; ConfigError naming `path:name`
    for a file missing, a module that does not import, a name it does not define, or one that
    is not callable. A file is imported as a module of its own (so that dataclasses and pickling
    inside it work), under a name made from its path."""
    where = f"{path}:{name}"
    module = _load_file(path, where, base_dir) if is_file_path(path) else _load_module(path, where)
    if not hasattr(module, name):
        defined = sorted(
            key
            for key, value in vars(module).items()
            if callable(value) and not key.startswith("_") and not inspect.isclass(value)
        )
        raise ConfigError(
            f"{where}: {path} defines no {name!r} (its functions: {', '.join(defined) or 'none'})"
        )
    function = getattr(module, name)
    if not callable(function):
        raise ConfigError(
            f"{where}: {name!r} is a {type(function).__name__}, not a function: "
            "[engine.task.reward] name must name a function"
        )
    return function  # type: ignore[no-any-return]


def _load_file(path: str, where: str, base_dir: Path | None) -> Any:
    file = resolve_file(path, base_dir)
    if not file.is_file():
        raise ConfigError(
            f"{where}: the reward file {file} does not exist ([engine.task.reward] path; a "
            "relative path is taken from the directory timeshare runs in)"
        )
    # One module per file: its resolved path, made a legal name.
    module_name = "timeshare_reward_" + re.sub(r"\W", "_", str(file.resolve()))
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where}: {file} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ConfigError(f"{where}: importing {file} failed: {_said(error)}") from error
    return module


def _load_module(path: str, where: str) -> Any:
    if not DOTTED_MODULE.fullmatch(path):
        raise ConfigError(
            f"{where}: [engine.task.reward] path must be a .py file or a dotted module name, "
            f"got {path!r}"
        )
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as error:
        if error.name is not None and (path == error.name or path.startswith(f"{error.name}.")):
            raise ConfigError(
                f"{where}: no module named {path!r} (a file path must end in .py)"
            ) from error
        raise ConfigError(f"{where}: importing {path} failed: {_said(error)}") from error
    except Exception as error:
        raise ConfigError(f"{where}: importing {path} failed: {_said(error)}") from error


def _said(error: BaseException) -> str:
    """An exception in one line, with where in the user's code it was raised."""
    said = "".join(traceback.format_exception_only(error)).strip()
    frames = traceback.extract_tb(error.__traceback__)
    if frames and "importlib" not in frames[-1].filename:
        said += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return said


# -- binding ---------------------------------------------------------------------------------------


def available(call: RewardCall) -> dict[str, Any]:
    """Every value a sample supplies, by name: the row's columns, verl's names, then the
    explicit names (which win over columns of the same name)."""
    values: dict[str, Any] = dict(call.row)
    values["data_source"] = call.row.get("data_source", "")
    values["extra_info"] = call.row.get("extra_info")
    values["solution_str"] = call.completion
    values["ground_truth"] = call.label
    values.update(
        completion=call.completion,
        prompt=call.prompt,
        label=call.label,
        finish_reason=call.finish_reason,
        completion_ids=call.completion_ids,
        step=call.step,
    )
    return values


def available_names(columns: Iterable[str]) -> list[str]:
    """The names a parameter may have, for a dataset with these columns."""
    return list(dict.fromkeys([*EXPLICIT_NAMES, *VERL_NAMES, *columns]))


def _signature(function: Callable[..., Any], where: str) -> inspect.Signature:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"{where}: its parameters cannot be read ({error}): arguments are bound by "
            "parameter name, so the function needs a signature"
        ) from error


def _describe(function: Callable[..., Any]) -> str:
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}:{name}"


def bind(function: Callable[..., Any], call: RewardCall) -> dict[str, Any]:
    """The arguments of `function` for `call`, by parameter name (positional-only ones too:
    `call_function` passes those positionally). A parameter with a default that nothing
    supplies keeps its default; `**kwargs` receives every value not bound otherwise;
    RewardFunctionError for a required parameter that nothing supplies."""
    values = available(call)
    signature = _signature(function, _describe(function))
    bound: dict[str, Any] = {}
    var_keyword = False
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            continue
        if parameter.kind is parameter.VAR_KEYWORD:
            var_keyword = True
        elif parameter.name in values:
            bound[parameter.name] = values[parameter.name]
        elif parameter.default is parameter.empty:
            raise RewardFunctionError(
                f"{_describe(function)}: nothing supplies its parameter {parameter.name!r} for "
                f"sample {call.sample_id} (row {call.row_index}); names available: "
                f"{', '.join(values)}"
            )
    if var_keyword:
        named = {p.name for p in signature.parameters.values()}
        bound.update({key: value for key, value in values.items() if key not in named})
    return bound


def check_signature(function: Callable[..., Any], where: str, columns: Iterable[str]) -> None:
    """ConfigError naming `where` and the parameter for a required parameter that no name
    supplies, given a dataset with these columns (listing the names available)."""
    names = available_names(columns)
    for parameter in _signature(function, where).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is parameter.empty and parameter.name not in names:
            raise ConfigError(
                f"{where}: nothing supplies its parameter {parameter.name!r} (give it a "
                f"default, or name it after one of: {', '.join(names)})"
            )


def call_function(function: Callable[..., Any], call: RewardCall) -> Any:
    """`function` called with its arguments bound from `call`; an `async def` one (or one that
    returns a coroutine) is run to its end with asyncio.run."""
    kwargs = bind(function, call)
    parameters = _signature(function, _describe(function)).parameters.values()
    positional = [
        kwargs.pop(p.name) for p in parameters if p.kind is p.POSITIONAL_ONLY and p.name in kwargs
    ]
    result = function(*positional, **kwargs)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result


# -- results ---------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


REWARD_IS = (
    'a reward is a number, a dict with a numeric "score" (its other numbers are extras), or '
    "None to skip the sample"
)


def _number(value: Any, where: str, what: str, rule: str = REWARD_IS) -> float:
    """`value` as a finite float (a bool as 0 or 1); RewardFunctionError naming `where`."""
    if not isinstance(value, numbers.Real):
        raise RewardFunctionError(
            f"{where} returned {what} of type {type(value).__name__} ({_shown(value)}): {rule}"
        )
    number = float(value)
    if not math.isfinite(number):
        raise RewardFunctionError(f"{where} returned {what} {number}: it must be a finite number")
    return number


def checked_result(value: Any, where: str) -> tuple[float | None, dict[str, float]]:
    """The score and extras a reward function's return value gives: a number (a bool as 0 or
    1); a dict with "score" (a number, or None to skip) and other finite numbers as extras
    (values that are no numbers, such as verl's "pred" text, are not figures: left out);
    None to skip the sample. Anything else is a RewardFunctionError naming `where` and what was
    received."""
    if value is None:
        return None, {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardFunctionError(
                f'{where} returned a dict without "score" (keys: '
                f"{', '.join(map(str, value)) or 'none'}): a dict reward needs a numeric "
                '"score"; its other numbers are extras'
            )
        score = value["score"]
        extras: dict[str, float] = {}
        for key, extra in value.items():
            if key == "score":
                continue
            if not isinstance(key, str):
                raise RewardFunctionError(
                    f"{where} returned a dict with the key {_shown(key)}: extras are named by "
                    "strings"
                )
            if not isinstance(extra, int | float):
                # (not a figure: verl's DAPO reward returns its parsed answer as "pred")
                continue
            extras[key] = _number(
                extra, where, f"the extra {key!r}", "numeric extras must be finite"
            )
        return (None if score is None else _number(score, where, '"score"')), extras
    return _number(value, where, "a score"), {}
