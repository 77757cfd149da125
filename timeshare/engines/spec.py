"""`[engine]`: which engine pair a job runs, and each engine's own settings.

The simulated pair's settings are here (its engines are one module, simulated.py); the
reference pair's are in torch_ref/spec.py. The reference pair's task can also be served by other
engines: vLLM as its rollout (`rollout = "vllm"`, vllm/spec.py) and FSDP2 over a transformers
model as its trainer (`trainer = "fsdp"`, fsdp/spec.py). No torch, no vLLM: the job config is
read without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from timeshare.engines.fsdp.spec import FsdpSpec
from timeshare.engines.torch_ref.spec import ModelConfig, TorchRefSpec, model_config
from timeshare.engines.vllm.spec import RolloutKind, VllmSpec
from timeshare.errors import ConfigError

EngineKind = Literal["simulated", "torch_ref"]
TrainerKind = Literal["", "fsdp"]


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
    # "": the pair's own trainer; "fsdp": FSDP2 over a transformers model trains the torch_ref
    # pair's task (engines/fsdp/).
    trainer: TrainerKind = ""
    simulated: SimulatedSpec = SimulatedSpec()
    torch_ref: TorchRefSpec = TorchRefSpec()
    vllm: VllmSpec = VllmSpec()
    fsdp: FsdpSpec = FsdpSpec()

    def __post_init__(self) -> None:
        for key, value in (("rollout", self.rollout), ("trainer", self.trainer)):
            if value and self.kind != "torch_ref":
                raise ConfigError(
                    f'engine.{key} = {value!r} needs engine.kind = "torch_ref" (the task it '
                    f"serves), not {self.kind!r}"
                )
        if self.trainer == "fsdp":
            self._check_fsdp()
        elif self.kind == "torch_ref":
            self.torch_ref.check_model(self.torch_ref.model, "engine.torch_ref.model")

    def _check_fsdp(self) -> None:
        if not self.fsdp.model_dir:
            raise ConfigError(
                'engine.fsdp.model_dir: trainer = "fsdp" trains a transformers model directory; '
                "name one (`timeshare model init DIR` makes a small one)"
            )
        for key, value, unset in (
            ("model_dir", self.torch_ref.model_dir, ""),
            ("model", self.torch_ref.model, ModelConfig()),
        ):
            if value != unset:
                raise ConfigError(
                    f"engine.torch_ref.{key}: the FSDP trainer's model is "
                    f"engine.fsdp.model_dir; leave engine.torch_ref.{key} unset"
                )
        micro = self.fsdp.micro_batch_size
        minibatch = self.torch_ref.batch_size // self.torch_ref.minibatches
        if micro and minibatch % micro:
            raise ConfigError(
                f"engine.fsdp.micro_batch_size ({micro}) does not divide a minibatch of "
                f"{minibatch} samples (engine.torch_ref: prompts_per_rank x group_size / "
                "minibatches)"
            )

    @property
    def trainer_name(self) -> str:
        return self.trainer or self.kind

    @property
    def rollout_name(self) -> str:
        """The rollout engine's name, for logs: the pair's own or the one `rollout` picks."""
        return self.rollout or self.kind


def served_model_dir(spec: EngineSpec) -> str:
    """The transformers directory of the model the job trains ("": the torch_ref pair's own)."""
    return spec.fsdp.model_dir if spec.trainer == "fsdp" else spec.torch_ref.model_dir


def served_model(spec: EngineSpec) -> ModelConfig:
    """The Llama keys of the model the job trains, for a rollout engine that builds its own."""
    if spec.trainer == "fsdp":
        return ModelConfig.from_json(Path(spec.fsdp.model_dir) / "config.json")
    return model_config(spec.torch_ref)


def rollout_vllm_spec(spec: EngineSpec) -> VllmSpec:
    """`[engine.vllm]` as the engine starts: from the FSDP trainer's model directory unless it
    names its own (the directory says the architecture; the first SYNC brings the weights)."""
    if spec.trainer == "fsdp" and not spec.vllm.model_dir:
        return msgspec.structs.replace(spec.vllm, model_dir=spec.fsdp.model_dir)
    return spec.vllm
