"""Ask SGLang whether it accepts `[engine.sglang]`, before any worker starts.

`probe` runs this module in a child process (importing SGLang takes seconds and sets up
process-wide state that a daemon should not carry):

    python -m timeshare.engines.sglang.args '<{"spec": SglangSpec, "model": ModelConfig} as JSON>'

The child checks each value that has choices in SGLang's own command line (its `argparse`
parser: `ServerArgs` itself takes `load_format="x"` and fails only as the engine starts), then
builds SGLang's `ServerArgs` from what the engine would pass (an unknown key is a `TypeError`
there), resolves and validates them as SGLang's `Engine` does (a value SGLang rejects fails
there), without starting an engine, and prints one JSON line: `{"ok": true}` or
`{"ok": false, "error": ...}`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from timeshare.engines.child_check import answer, ask_child
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.sglang.spec import TYPED_ARGS, SglangSpec
from timeshare.errors import ConfigError

if TYPE_CHECKING:
    from timeshare.engines.registry import Role
    from timeshare.engines.spec import EngineChoice

CHECK_TIMEOUT_S = 120.0  # the import of SGLang and its argument resolution, on a loaded machine
INSTALL = "make .venv-sglang/.installed, then run timeshare from .venv-sglang/bin/python"


NO_BATCH_INVARIANCE_ON_CPU = (
    "engine.batch_invariant: SGLang has no batch-invariant mode on cpu (its deterministic "
    "inference takes the attention backends of a CUDA device, not the CPU engine's torch_native)"
)


class _Check(msgspec.Struct, frozen=True):
    spec: SglangSpec
    model: ModelConfig
    batch_invariant: bool = False  # [engine] batch_invariant


def probe(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's probe (registry.py): SGLang is installed here and accepts the engine's
    arguments for the model the trainer trains."""
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            f"engine.rollout = 'sglang': SGLang is not installed for {sys.executable} ({INSTALL})"
        )
    trained = spec.served_model()
    own = spec.settings("sglang", SglangSpec).starting_from(trained)
    check_server_args(own, trained.config, batch_invariant=spec.batch_invariant)


def check_server_args(
    spec: SglangSpec, model: ModelConfig, *, batch_invariant: bool = False
) -> None:
    """A `ConfigError` naming the key if SGLang, asked in a child process, refuses `spec` for
    `model` (`batch_invariant`: with its deterministic inference, on the device "auto" means
    there)."""
    payload = msgspec.json.encode(_Check(spec, model, batch_invariant)).decode()
    ask_child(
        "timeshare.engines.sglang.args", payload, "engine.sglang: SGLang's check", CHECK_TIMEOUT_S
    )


def _verdict(check: _Check) -> dict[str, Any]:
    # Imported here, in the checking child only: the config is read without SGLang.
    from timeshare.engines.model_dir import write_config_dir  # noqa: PLC0415
    from timeshare.engines.sglang.engine import resolve_device, server_args  # noqa: PLC0415

    device = resolve_device(check.spec)
    if check.batch_invariant and device == "cpu":
        return {"ok": False, "error": NO_BATCH_INVARIANCE_ON_CPU}
    if device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # before SGLang is imported: it reads it then
    from sglang.srt.arg_groups.pipeline import run_resolution_pipeline  # noqa: PLC0415
    from sglang.srt.server_args import (  # noqa: PLC0415
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        ServerArgs,
    )

    if check.batch_invariant:  # (SGLang's own refusal would not name the key)
        takes = DETERMINISTIC_ATTENTION_BACKEND_CHOICES
        problem = check.spec.deterministic_problem(device, takes)
        if problem:
            return {"ok": False, "error": problem}

    with tempfile.TemporaryDirectory(prefix="timeshare-sglang-check-") as scratch:
        model_dir = check.spec.model_dir or str(write_config_dir(check.model, Path(scratch)))
        args = server_args(
            check.spec,
            model_dir,
            device,
            dummy=not check.spec.model_dir,
            batch_invariant=check.batch_invariant,
        )
        problem = _outside_choices(check.spec, args)
        if problem:
            return {"ok": False, "error": problem}
        try:
            resolved = ServerArgs(**args)
        except TypeError as exc:
            return {"ok": False, "error": _unknown_key(str(exc))}
        try:
            run_resolution_pipeline(resolved)
            resolved.check_server_args()
        except Exception as exc:
            return {"ok": False, "error": _rejected(check.spec, exc)}
    return {"ok": True}


def _outside_choices(spec: SglangSpec, args: dict[str, Any]) -> str:
    """The first value the user set that SGLang's command line would refuse ("": none)."""
    import argparse  # noqa: PLC0415

    from sglang.srt.server_args import ServerArgs  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    choices = {action.dest: action.choices for action in parser._actions if action.choices}
    for key in [*TYPED_ARGS, *spec.server_args]:
        allowed = choices.get(key)
        value = args.get(key)
        if allowed is None or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if item not in allowed:
                named = TYPED_ARGS.get(key)
                where = f"engine.sglang.{named}" if named else f"engine.sglang.server_args.{key}"
                return f"{where}: SGLang takes one of {sorted(map(str, allowed))}, not {item!r}"
    return ""


def _unknown_key(message: str) -> str:
    match = re.search(r"(?:unexpected )?keyword argument '([^']+)'", message, re.IGNORECASE)
    if match:
        return f"engine.sglang.server_args.{match.group(1)}: SGLang has no such server argument"
    return f"engine.sglang.server_args: SGLang refused them: {message}"


def _rejected(spec: SglangSpec, exc: Exception) -> str:
    message = f"{type(exc).__name__}: {exc}"
    named = [key for key in spec.server_args if key in message]
    where = f"engine.sglang.server_args.{named[0]}" if named else "engine.sglang"
    return f"{where}: SGLang rejected the server arguments: {message[:1500]}"


def main() -> None:
    check = msgspec.json.decode(sys.argv[1], type=_Check)
    answer(_verdict(check))


if __name__ == "__main__":
    main()
