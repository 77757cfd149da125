"""The reference engine pair: GRPO on a small causal LM in plain PyTorch (CPU or GPU).

The settings (`TorchRefSpec`, `ModelConfig`) import without torch, because the job config embeds
them and reading a config must not load torch. The other names live in modules that import
torch; they are imported on first use (PEP 562 `__getattr__`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from timeshare.engines.torch_ref.spec import ModelConfig, TorchRefSpec

if TYPE_CHECKING:
    # mypy sees the real types through these imports; at run time `__getattr__` below imports
    # them on first use. mypy never sees that `__getattr__` (it would type every unknown
    # attribute of this package as its return type, hiding a misspelt import).
    from timeshare.engines.torch_ref.model import CausalLM
    from timeshare.engines.torch_ref.rollout import TorchRefRollout
    from timeshare.engines.torch_ref.task import RepeatDigit
    from timeshare.engines.torch_ref.trainer import TorchRefTrainer
else:
    _TORCH_NAMES = {
        "CausalLM": "timeshare.engines.torch_ref.model",
        "RepeatDigit": "timeshare.engines.torch_ref.task",
        "TorchRefRollout": "timeshare.engines.torch_ref.rollout",
        "TorchRefTrainer": "timeshare.engines.torch_ref.trainer",
    }

    def __getattr__(name: str) -> object:
        if name not in _TORCH_NAMES:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_TORCH_NAMES[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value


__all__ = [
    "CausalLM",
    "ModelConfig",
    "RepeatDigit",
    "TorchRefRollout",
    "TorchRefSpec",
    "TorchRefTrainer",
]
