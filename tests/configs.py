"""The one builder of test jobs: a nested dict, as a `Config` for in-process runs or as a TOML
file for the programs (`timeshare run`, `timeshared`).

Presets name what a test runs: `FAST` (simulated engines, tight deadlines: the driver's own
tests), `SERVICE` (simulated engines behind a daemon), `TINY` (the reference engine at its
smallest). `sections` override them key by key, table by table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from timeshare.config import Config

FAST: dict[str, Any] = {
    "job": {"ranks": 1, "steps": 1},
    "deadlines": {"phase_s": 12.0, "stall_s": 1.5, "barrier_s": 10.0},
    "transfer": {  # every channel deadline inside a phase's, as the config's loader requires
        "bucket_mb": 1.0,
        "ack_timeout_s": 10.0,
        "finalize_timeout_s": 10.0,
        "handshake_timeout_s": 10.0,
        "begin_timeout_s": 10.0,
    },
}
SERVICE: dict[str, Any] = {
    "job": {"ranks": 2, "steps": 100_000},
    "deadlines": {"phase_s": 30.0, "stall_s": 5.0, "barrier_s": 10.0, "ready_s": 60.0},
    "transfer": {"bucket_mb": 0.25},
    "engine": {"simulated": {"delays": {"rollout": {"0": 0.02, "1": 0.02}}}},
    "daemon": {"metrics_port": 0, "max_request_bytes": 4096, "max_clients": 8, "drain_s": 60.0},
}
TINY: dict[str, Any] = {
    "job": {"ranks": 2, "steps": 3},
    "deadlines": {"phase_s": 30.0, "stall_s": 10.0, "ready_s": 90.0},
    "transfer": {"bucket_mb": 0.0625, "checksum": True},
    "engine": {
        "trainer": "torch_ref",
        "rollout": "torch_ref",
        "task": {"prompts_per_rank": 2, "group_size": 4, "max_completion_tokens": 4},
        "torch_ref": {
            "kv_cache_len": 16,
            "model": {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 16},
        },
    },
}


def job(root: Path, preset: Mapping[str, Any], **sections: Any) -> dict[str, Any]:
    """`preset` in `root` (runtime, checkpoints, daemon state), with `sections` over it."""
    paths: dict[str, Any] = {
        "job": {"runtime_dir": f"{root}/run", "checkpoint_dir": f"{root}/checkpoints"},
    }
    if "daemon" in preset or "daemon" in sections:
        paths["daemon"] = {"state_dir": f"{root}/state"}
    return merged(merged(paths, preset), sections)


def config(root: Path, preset: Mapping[str, Any] = FAST, **sections: Any) -> Config:
    """An in-process job: a fast one with simulated engines unless told otherwise. Typed and
    range-checked, but not checked for nesting deadlines, so that a test may set one deadline
    tight and leave the others at values that would not nest with it."""
    return msgspec.convert(job(root, preset, **sections), Config)


def toml_file(
    root: Path, preset: Mapping[str, Any], name: str = "job.toml", **sections: Any
) -> Path:
    """The job as a TOML file in `root`, for a program to read."""
    path = root / name
    path.write_text(toml(job(root, preset, **sections)))
    return path


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on `base`, table by table (a value that is not a table, a list included, replaces)."""
    result = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """Nested dicts as TOML: values first, then tables, then arrays of tables ([[faults]])."""
    values = {k: v for k, v in data.items() if not _is_table(v) and not _is_tables(v)}
    lines = [f"{_key(k)} = {_value(v)}" for k, v in values.items()]
    text = "\n".join(lines) + ("\n" if lines else "")
    for key, value in data.items():
        name = f"{prefix}{_key(key)}"
        if _is_table(value):
            text += f"\n[{name}]\n" + toml(value, f"{name}.")
        elif _is_tables(value):
            for table in value:
                text += f"\n[[{name}]]\n" + toml(table, f"{name}.")
    return text


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _key(key: str) -> str:
    return key if key.replace("_", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # strings, and lists of scalars
