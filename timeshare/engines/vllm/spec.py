"""`[engine.vllm]`: the settings of the vLLM rollout engine, typed, plus `engine_args` for the rest.

No vLLM and no torch here: the job config is read without them. Whether vLLM accepts the keys of
`engine_args` is asked of vLLM itself, once, before any worker starts (`check_engine_args` in
args.py, called by `timeshare run` and `timeshared` at load time).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from timeshare.engines.footprint import DTYPE_BYTES, RolloutFootprint
from timeshare.engines.model_config import TrainedModel
from timeshare.errors import ConfigError
from timeshare.units import Seconds

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]

# What the engine sets itself, whatever engine_args says: the weights arrive through timeshare's
# backend (never a tokenizer, never pickle), logprobs are those of the sampled distribution.
RESERVED_ARGS = frozenset(
    {
        "model",
        "weight_transfer_config",
        "worker_extension_cls",
        "skip_tokenizer_init",
        "logprobs_mode",
        "enable_sleep_mode",
    }
)
# engine_args keys that have a typed key of their own in [engine.vllm].
TYPED_ARGS = {
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "kv_cache_memory_bytes": "kv_cache_mb",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "tensor_parallel_size": "tensor_parallel_size",
    "enforce_eager": "enforce_eager",
    "seed": "seed",
}
# vLLM's batch-invariant kernels ([engine] batch_invariant), in the environment of the engine's
# processes while it starts them
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


class VllmSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the vLLM rollout engine of a job needs; its worker gets it as JSON."""

    # A transformers model directory vLLM loads. Empty: the trainer's own model; the engine
    # writes its config.json and starts from dummy weights, which the first SYNC replaces.
    model_dir: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    max_model_len: PositiveInt = 64
    # The KV cache: a size (what a CPU or a shared device needs), or a fraction of the device.
    kv_cache_mb: Annotated[float, msgspec.Meta(gt=0.0)] | None = 64.0
    gpu_memory_utilization: Fraction | None = None
    tensor_parallel_size: PositiveInt = 1
    enforce_eager: bool = True
    seed: int = 0
    sleep_level: Literal[1, 2] = 1  # where vLLM has sleep mode (CUDA): what OFFLOAD releases
    # A generate still running after this is aborted inside vLLM (the engine stays usable).
    generate_timeout_s: Seconds = 20.0
    engine_args: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if (self.kv_cache_mb is None) == (self.gpu_memory_utilization is None):
            raise ConfigError(
                "engine.vllm: set exactly one of kv_cache_mb and gpu_memory_utilization "
                f"(got kv_cache_mb={self.kv_cache_mb}, "
                f"gpu_memory_utilization={self.gpu_memory_utilization})"
            )
        for key in self.engine_args:
            if key in RESERVED_ARGS:
                raise ConfigError(
                    f"engine.vllm.engine_args.{key}: set by timeshare itself; leave it out"
                )
            if key in TYPED_ARGS:
                raise ConfigError(
                    f"engine.vllm.engine_args.{key}: use engine.vllm.{TYPED_ARGS[key]} instead"
                )

    def rollout_footprint(self, sequences: int) -> RolloutFootprint:
        """Weights in `dtype`, split over tensor_parallel_size ranks; the KV cache a size per
        rank, or what gpu_memory_utilization of the device leaves beside the weights."""
        by_size = self.kv_cache_mb is not None
        return RolloutFootprint(
            tensor_parallel=self.tensor_parallel_size,
            tp_key="engine.vllm.tensor_parallel_size",
            weight_bytes=DTYPE_BYTES.get(self.dtype),
            kv_cache_bytes=self.kv_cache_mb * (1 << 20) if self.kv_cache_mb is not None else None,
            kv_cache_tokens=None,
            memory_fraction=self.gpu_memory_utilization,
            kv_key="engine.vllm.kv_cache_mb" if by_size else "engine.vllm.gpu_memory_utilization",
            longest_sequence=self.max_model_len,
            longest_key="engine.vllm.max_model_len",
        )

    def typed_args(self) -> dict[str, Any]:
        """The typed keys as vLLM's engine arguments."""
        args: dict[str, Any] = {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
        }
        if self.kv_cache_mb is not None:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_mb * (1 << 20))
        else:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        return args

    def starting_from(self, trained: TrainedModel) -> VllmSpec:
        """As the engine starts: from the trained model's directory unless `model_dir` names
        its own (the directory says the architecture; the first SYNC brings the weights)."""
        if self.model_dir or not trained.directory:
            return self
        return msgspec.structs.replace(self, model_dir=trained.directory)
