"""Ask vLLM whether it accepts `[engine.vllm]`, before any worker starts.

`check_engine_args` runs this module in a child process (importing vLLM takes 10-15 s and sets
up process-wide state that a daemon should not carry):

    python -m timeshare.engines.vllm.args '<{"spec": VllmSpec, "model": ModelConfig} as JSON>'

The child builds vLLM's `EngineArgs` from what the engine would pass (an unknown key is a
`TypeError` there) and then vLLM's engine config (a value vLLM rejects fails there), without
starting an engine, and prints one JSON line: `{"ok": true}` or `{"ok": false, "error": ...}`.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from timeshare.engines.child_check import answer, ask_child
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.vllm.spec import BATCH_INVARIANT_ENV, VllmSpec

if TYPE_CHECKING:
    from timeshare.engines.registry import Role
    from timeshare.engines.spec import EngineChoice

CHECK_TIMEOUT_S = 120.0  # the import of vLLM and one engine config, on a loaded machine


class _Check(msgspec.Struct, frozen=True):
    spec: VllmSpec
    model: ModelConfig
    batch_invariant: bool = False  # [engine] batch_invariant


def probe(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's probe (registry.py): vLLM accepts the engine's arguments for the model
    the trainer trains."""
    trained = spec.served_model()
    own = spec.settings("vllm", VllmSpec).starting_from(trained)
    check_engine_args(own, trained.config, batch_invariant=spec.batch_invariant)


def check_engine_args(spec: VllmSpec, model: ModelConfig, *, batch_invariant: bool = False) -> None:
    """A `ConfigError` naming the key if vLLM rejects the engine's arguments, or naming the
    platform if it has no batch-invariant mode there and one is asked for."""
    payload = msgspec.json.encode(_Check(spec, model, batch_invariant)).decode()
    ask_child("timeshare.engines.vllm.args", payload, "engine.vllm: vLLM's check", CHECK_TIMEOUT_S)


def _verdict(check: _Check) -> dict[str, Any]:
    # Imported here, in the checking child only: the config is read without vLLM.
    from timeshare.engines.model_dir import write_config_dir  # noqa: PLC0415
    from timeshare.engines.vllm.engine import engine_args  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.platforms import current_platform  # noqa: PLC0415

    if check.batch_invariant:
        if not current_platform.is_cuda():
            return {"ok": False, "error": no_batch_invariance(current_platform.device_type)}
        os.environ[BATCH_INVARIANT_ENV] = "1"  # (this child's alone: its engine config checks)
    else:  # as the engine starts: none inherited (invariance.remove_inherited_switches)
        os.environ.pop(BATCH_INVARIANT_ENV, None)
    with tempfile.TemporaryDirectory(prefix="timeshare-vllm-check-") as scratch:
        model_dir = check.spec.model_dir or str(write_config_dir(check.model, Path(scratch)))
        args = engine_args(check.spec, model_dir, sleep_mode=False)
        try:
            engine = EngineArgs(**args)
        except TypeError as exc:
            return {"ok": False, "error": _unknown_key(str(exc))}
        try:
            engine.create_engine_config()
        except Exception as exc:
            return {"ok": False, "error": _rejected(check.spec, exc)}
    return {"ok": True}


def no_batch_invariance(platform: str) -> str:
    return (
        f"engine.batch_invariant: vLLM has no batch-invariant mode on {platform} (its "
        f"{BATCH_INVARIANT_ENV} installs Triton kernels, which need a CUDA device)"
    )


def _unknown_key(message: str) -> str:
    match = re.search(r"unexpected keyword argument '([^']+)'", message)
    if match:
        return f"engine.vllm.engine_args.{match.group(1)}: vLLM has no such engine argument"
    return f"engine.vllm.engine_args: vLLM refused them: {message}"


def _rejected(spec: VllmSpec, exc: Exception) -> str:
    message = f"{type(exc).__name__}: {exc}"
    named = [key for key in spec.engine_args if key in message]
    where = f"engine.vllm.engine_args.{named[0]}" if named else "engine.vllm"
    return f"{where}: vLLM rejected the engine arguments: {message[:1500]}"


def main() -> None:
    check = msgspec.json.decode(sys.argv[1], type=_Check)
    answer(_verdict(check))


if __name__ == "__main__":
    main()
