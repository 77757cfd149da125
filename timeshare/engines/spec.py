"""`[engine]`: which engine pair a job runs, and each pair's own settings."""

from __future__ import annotations

from typing import Literal

import msgspec

from timeshare.engines.simulated import SimulatedSpec
from timeshare.engines.torch_ref.spec import TorchRefSpec

EngineKind = Literal["simulated", "torch_ref"]


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: EngineKind = "simulated"
    simulated: SimulatedSpec = SimulatedSpec()
    torch_ref: TorchRefSpec = TorchRefSpec()
