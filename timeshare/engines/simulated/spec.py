"""`[engine.simulated]`: the sizes and delays of the simulated engines. No torch here."""

from __future__ import annotations

import msgspec

from timeshare.units import Seconds


class SimulatedSizes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """MiB each part takes on a simulated device."""

    device_mb: float = 100.0
    params_mb: float = 30.0
    optimizer_mb: float = 40.0
    staging_mb: float = 10.0
    weights_mb: float = 35.0
    kv_cache_mb: float = 50.0


class SimulatedSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the simulated engines of a job need; workers get it as JSON."""

    sizes: SimulatedSizes = SimulatedSizes()
    engine_span: int = 1  # ranks (devices) one rollout engine spans; its leader wakes them all
    tensors: int = 4
    tensor_numel: int = 1024
    account_memory: bool = True  # off: no ledger at all (to measure orchestration alone)
    # phase -> rank (a string, as TOML keys are) -> seconds of (progressing) work
    delays: dict[str, dict[str, float]] = {}
    # A generate (with its simulated delay) still running after this is aborted; None: 0.9 of
    # the ROLLOUT command's deadline, which it runs inside.
    generate_timeout_s: Seconds | None = None
    # A drill of a rollout holding other weights than its trainer sent: rank (a string, as TOML
    # keys are) -> the first weight version that rank's rollout loads altered (one value of its
    # last tensor changed after loading), that version and every later one.
    corrupt_weights: dict[str, int] = {}
