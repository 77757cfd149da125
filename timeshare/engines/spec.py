"""`[engine]`: which engine pair a job runs, and each engine's own settings.

The simulated pair's settings are here (its engines are one module, simulated.py); the
reference pair's are in torch_ref/spec.py, vLLM's (a rollout engine for the reference pair's
trainer) in vllm/spec.py. No torch, no vLLM: the job config is read without them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from timeshare.engines.torch_ref.spec import TorchRefSpec
from timeshare.engines.vllm.spec import RolloutKind, VllmSpec
from timeshare.errors import ConfigError

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
    # "": the pair's own rollout engine; "vllm": vLLM serves the rollout of the torch_ref pair
    # (its model and task), as the rollout engine of a real run (engines/vllm/).
    rollout: RolloutKind = ""
    simulated: SimulatedSpec = SimulatedSpec()
    torch_ref: TorchRefSpec = TorchRefSpec()
    vllm: VllmSpec = VllmSpec()

    def __post_init__(self) -> None:
        if self.rollout == "vllm" and self.kind != "torch_ref":
            raise ConfigError(
                f'engine.rollout = "vllm" needs engine.kind = "torch_ref" (the trainer and '
                f"task it serves), not {self.kind!r}"
            )

    @property
    def rollout_name(self) -> str:
        """The rollout engine's name, for logs: the pair's own or the one `rollout` picks."""
        return self.rollout or self.kind
