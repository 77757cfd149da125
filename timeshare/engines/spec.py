"""`[engine]`: which engine pair a job runs, and each pair's own settings.

The simulated pair's settings are here (its engines are one module, simulated.py); the
reference pair's are in torch_ref/spec.py. No torch: the job config is read without it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from timeshare.engines.torch_ref.spec import TorchRefSpec

EngineKind = Literal["simulated", "torch_ref"]


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


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: EngineKind = "simulated"
    simulated: SimulatedSpec = SimulatedSpec()
    torch_ref: TorchRefSpec = TorchRefSpec()
