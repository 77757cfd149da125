"""`[engine.sglang]`: the settings of the SGLang rollout engine, typed, plus `server_args` for the
rest, passed to SGLang's `Engine` whole.

No SGLang and no torch here: the job config is read without them. Whether SGLang accepts the
keys and values of `server_args` is asked of SGLang itself, once, before any worker starts
(`probe` in args.py, called by `timeshare run` and `timeshared` at load time).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from timeshare.engines.footprint import DTYPE_BYTES, RolloutFootprint
from timeshare.engines.model_config import TrainedModel
from timeshare.errors import ConfigError
from timeshare.units import Seconds

if TYPE_CHECKING:
    from timeshare.engines.registry import Role
    from timeshare.engines.spec import EngineChoice

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

# What the engine sets itself, whatever server_args says: the weights arrive through timeshare's
# loader inside SGLang's scheduler (never a tokenizer, never tensors through SGLang's pickle).
RESERVED_ARGS = frozenset(
    {
        "model_path",
        "custom_weight_loader",
        "skip_tokenizer_init",
        "enable_memory_saver",
        "log_level",
    }
)
# server_args keys that have a typed key of their own in [engine.sglang].
TYPED_ARGS = {
    "dtype": "dtype",
    "context_length": "context_length",
    "max_total_tokens": "max_total_tokens",
    "tp_size": "tp_size",
    "attention_backend": "attention_backend",
    "random_seed": "seed",
    "device": "device",
}


# SGLang's CPU engine's attention backend, which its deterministic inference refuses
TORCH_NATIVE = "torch_native"
# What to set instead on CUDA (SGLang's list, DETERMINISTIC_ATTENTION_BACKEND_CHOICES, is asked
# by the probe; fa3 needs Hopper)
DETERMINISTIC_ON_CUDA = "triton, flashinfer or fa3"


class SglangSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the SGLang rollout engine of a job needs; its worker gets it as JSON."""

    # A transformers model directory SGLang loads. Empty: the trainer's own model directory
    # (SGLang reads its architecture there; the first SYNC brings the trainer's weights).
    model_dir: str = ""
    # "auto": cuda where torch has a device, else SGLang's CPU engine.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    # The longest sequence SGLang holds; None: the model's own (its max_position_embeddings).
    context_length: PositiveInt | None = None
    # The KV cache, in tokens (SGLang's max_total_tokens): what a CPU or a shared device needs.
    max_total_tokens: PositiveInt = 4096
    # SGLang's tensor-parallel ranks: each rank's scheduler receives every version (the
    # trainer's sender sends each bucket once, to all of them) and loads its own shard.
    tp_size: PositiveInt = 1
    # torch_native: the backend SGLang's CPU engine runs; on GPUs flashinfer, triton or fa3.
    attention_backend: str = "torch_native"
    seed: int = 0
    # OFFLOAD releases SGLang's weights and KV cache (release_memory_occupation), RESUME brings
    # them back (weights before SYNC, KV cache after BARRIER). Where torch_memory_saver cannot
    # free them (CPU) they stay resident, and the engine says so.
    release_memory: bool = True
    # A generate still running after this is aborted inside SGLang (the engine stays usable).
    generate_timeout_s: Seconds = 20.0
    server_args: dict[str, object] = {}

    def rollout_footprint(self, sequences: int) -> RolloutFootprint:
        """Weights in `dtype`, split over tp_size ranks; a KV cache of max_total_tokens
        tokens."""
        return RolloutFootprint(
            tensor_parallel=self.tp_size,
            tp_key="engine.sglang.tp_size",
            weight_bytes=DTYPE_BYTES.get(self.dtype),
            kv_cache_bytes=None,
            kv_cache_tokens=self.max_total_tokens,
            memory_fraction=None,
            kv_key="engine.sglang.max_total_tokens",
            longest_sequence=self.context_length or 0,  # 0: the model's own
            longest_key="engine.sglang.context_length",
        )

    def __post_init__(self) -> None:
        for key in self.server_args:
            if key in RESERVED_ARGS:
                raise ConfigError(
                    f"engine.sglang.server_args.{key}: set by timeshare itself; leave it out"
                )
            if key in TYPED_ARGS:
                raise ConfigError(
                    f"engine.sglang.server_args.{key}: use engine.sglang.{TYPED_ARGS[key]} instead"
                )

    def deterministic_problem(self, device: str, takes: Collection[str] = ()) -> str:
        """Why SGLang's deterministic inference (`[engine] batch_invariant`) cannot run with
        `attention_backend` on `device` (what "auto" resolved to), "" if it can: torch_native
        never, another backend where `takes` (SGLang's own list, when asked) leaves it out.
        (On a CPU SGLang has no such mode at all: args.py refuses it.)"""
        backend = self.attention_backend
        if device != "cuda" or (backend != TORCH_NATIVE and (not takes or backend in takes)):
            return ""
        choices = ", ".join(sorted(takes)) if takes else DETERMINISTIC_ON_CUDA
        return (
            f"engine.sglang.attention_backend ({backend!r}): engine.batch_invariant runs "
            "SGLang with its deterministic inference, which does not take that backend; set "
            f"engine.sglang.attention_backend to one it takes on cuda ({choices})"
        )

    def typed_args(self, device: str) -> dict[str, object]:
        """The typed keys as SGLang's server arguments, on `device` (what "auto" resolved to)."""
        args: dict[str, object] = {
            "device": device,
            "dtype": self.dtype,
            "max_total_tokens": self.max_total_tokens,
            "tp_size": self.tp_size,
            "attention_backend": self.attention_backend,
            "random_seed": self.seed,
        }
        if self.context_length is not None:
            args["context_length"] = self.context_length
        return args

    def starting_from(self, trained: TrainedModel) -> SglangSpec:
        """As the engine starts: from the trained model's directory unless `model_dir` names
        its own."""
        if self.model_dir or not trained.directory:
            return self
        return msgspec.structs.replace(self, model_dir=trained.directory)


def check(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's check (registry.py): under `[engine] batch_invariant` on a device set to
    "cuda", an attention backend SGLang's deterministic inference takes ("auto" is resolved,
    and SGLang's own list asked, by the probe: args.py)."""
    sglang = spec.settings("sglang", SglangSpec)
    if spec.batch_invariant and sglang.device == "cuda":
        problem = sglang.deterministic_problem("cuda")
        if problem:
            raise ConfigError(problem)
