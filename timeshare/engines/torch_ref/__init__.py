"""The reference engine pair: GRPO on a small causal LM in plain PyTorch (CPU or GPU)."""

from timeshare.engines.torch_ref.model import CausalLM, ModelConfig
from timeshare.engines.torch_ref.rollout import TorchRefRollout
from timeshare.engines.torch_ref.spec import TorchRefSpec
from timeshare.engines.torch_ref.task import RepeatDigit
from timeshare.engines.torch_ref.trainer import TorchRefTrainer

__all__ = [
    "CausalLM",
    "ModelConfig",
    "RepeatDigit",
    "TorchRefRollout",
    "TorchRefSpec",
    "TorchRefTrainer",
]
