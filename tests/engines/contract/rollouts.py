"""Each rollout engine as the contract suite drives it: built through the registry, fed through
the real weight channel by a trainer built through the registry, and watched by a witness of its
memory that does not ask the engine.

A harness knows what the suite needs to know about its engine and nothing the engine declares
itself (`traits()` says that): where its weights come from, how many requests a generate may
hold, and an independent view of what it holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from tests.engines.contract.channel import TRANSFER, Channel, Outcome
from tests.engines.foreign_hosts import child_pids, stop_resource_tracker_when_alone
from timeshare.engines import registry
from timeshare.engines.base import (
    RolloutRequest,
    SamplingParams,
    TrainerEngine,
)
from timeshare.engines.context import EngineContext
from timeshare.engines.pairs import build_rollout, build_trainer
from timeshare.engines.simulated.engines import DeviceLedger
from timeshare.engines.simulated.spec import SimulatedSpec
from timeshare.engines.spec import EngineSpec, engine_spec
from timeshare.engines.torch_ref.rollout import TorchRefRollout
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights.layout import Weight
from timeshare.task.vocab import BOS, DIGITS, PROMPT_DIGITS, SEP
from timeshare.units import MIB

# The causal LM every causal_lm engine serves: head_dim 32, the smallest vLLM's CPU attention
# takes; the reference trainer's, by name (transformers' Llama names).
MODEL: dict[str, Any] = {
    "vocab_size": 16,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
COMPLETION = 4
TASK: dict[str, Any] = {"prompts_per_rank": 2, "group_size": 4, "max_completion_tokens": COMPLETION}
BATCH = 8  # prompts_per_rank x group_size: what the reference rollout's KV cache holds
KV_CACHE_LEN = 16  # the reference rollout's sequence (so that a long prompt is cheap to make)
# The first generate warms vLLM up; every call into it may wait on two busy cores.
VLLM: dict[str, Any] = {"generate_timeout_s": 120.0}
VLLM_CALL_TIMEOUT_S = 120.0
SGLANG: dict[str, Any] = {"generate_timeout_s": 120.0, "max_total_tokens": 1024}
SGLANG_CALL_TIMEOUT_S = 120.0
# Each simulated generate takes this long, so that a short deadline can pass during one.
SIMULATED: dict[str, Any] = {"tensor_numel": 8192, "delays": {"rollout": {"0": 0.05}}}

Named = list[tuple[str, Weight]]


def causal_lm_job(rollout: str, seed: int = 0, tensor_parallel: int = 1) -> EngineSpec:
    """The reference trainer of MODEL (initialised from `seed`) with `rollout` serving it, its
    weights loaded by `tensor_parallel` workers (vLLM, SGLang)."""
    sections: dict[str, Any] = {
        "vllm": {**VLLM, "tensor_parallel_size": tensor_parallel},
        "sglang": {**SGLANG, "tp_size": tensor_parallel},
    }
    sections = {rollout: sections[rollout]} if rollout in sections else {}
    return engine_spec(
        trainer="torch_ref",
        rollout=rollout,
        task=TASK,
        torch_ref={"model": MODEL, "seed": seed, "kv_cache_len": KV_CACHE_LEN},
        **sections,
    )


def simulated_job() -> EngineSpec:
    return engine_spec(trainer="simulated", rollout="simulated", simulated=SIMULATED)


def sampling(
    seed: int | None, max_tokens: int = COMPLETION, stop: tuple[int, ...] = ()
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=seed, stop_token_ids=stop
    )


class Witness(Protocol):
    """What an engine holds, seen without asking the engine."""

    def held_mb(self) -> float: ...


class Storages:
    """The storages under some tensors, by weak reference: what of them is still alive."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        seen = {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}
        self.refs = [weakref.ref(storage) for storage in seen.values()]

    def held_mb(self) -> float:
        return sum(s.nbytes() for ref in self.refs if (s := ref()) is not None) / MIB


class DeviceInUse:
    """A simulated device's memory in use, as the job store's ledger has it."""

    def __init__(self, ledger: DeviceLedger, device: int) -> None:
        self.ledger = ledger
        self.device = device

    def held_mb(self) -> float:
        return self.ledger.used(self.device)


class RolloutHarness:
    """One rollout engine and the trainer's end of its weight channel."""

    kind = ""
    case = ""  # the suite's name for it: the kind, and its tensor parallelism where > 1
    most_requests = BATCH  # the most requests one generate may hold
    longest = COMPLETION  # the longest completion a request of that many may ask for
    logprob_tolerance = 1e-4  # against the trainer's logprobs of the same tokens
    loader_name = ""  # how its loader's refusals name the engine

    def __init__(self, spec: EngineSpec, *, call_timeout_s: float = 30.0) -> None:
        self.spec = spec
        self.children_before = child_pids()  # (another module's engine may be running)
        self.channel = Channel(prefix=f"ts-{self.kind[:3]}-", receivers=spec.rollout_workers())
        self.store = JobStore.host()
        self.sources_store = JobStore.host()  # the trainers' own (simulated) device ledger
        self._trainers: dict[int, TrainerEngine] = {}
        self.version = 0  # the last version sent
        self.variant = 0  # the trainer whose weights the engine holds whole
        context = EngineContext(
            spec=spec,
            rank=0,
            world_size=1,
            store=self.store,
            call_timeout_s=call_timeout_s,
            runtime_dir=self.channel.runtime_dir,
        )
        try:
            self.engine = build_rollout(context)
        except BaseException:
            self.channel.close()
            raise
        try:
            self.engine.generate(self.requests(seed=0))
        except Exception as exc:
            self.before_first_version: Exception | None = exc
        else:
            self.before_first_version = None
        self.inlet = self.engine.open_inlet(self.channel.endpoint, TRANSFER)

    @property
    def family(self) -> registry.Family:
        return registry.find(self.kind, "rollout").family

    # -- weights --------------------------------------------------------------------------------

    def trainer_spec(self, variant: int) -> EngineSpec:
        raise NotImplementedError

    def trainer(self, variant: int) -> TrainerEngine:
        """A trainer built through the registry whose weights are those of `variant`."""
        if variant not in self._trainers:
            context = EngineContext(
                spec=self.trainer_spec(variant), rank=0, world_size=1, store=self.sources_store
            )
            self._trainers[variant] = self.trained(build_trainer(context), variant)
        return self._trainers[variant]

    def trained(self, trainer: TrainerEngine, variant: int) -> TrainerEngine:
        return trainer

    def weights(self, variant: int = 0) -> Named:
        return list(self.trainer(variant).iter_weights())

    def attempt(self, weights: Named) -> Outcome:
        """One SYNC as the rollout worker runs it: torn, weights woken, one version received."""
        self.version += 1

        def receive() -> Any:
            self.engine.begin_weight_update()
            self.engine.wake({"weights"})
            return self.inlet.receive(lambda: None)

        return self.channel.transfer(weights, self.version, receive)

    def sync(self, variant: int = 0) -> Outcome:
        """A whole version of `variant`'s weights, then the KV cache woken (RESUME)."""
        outcome = self.attempt(self.weights(variant))
        outcome.reports()
        self.variant = variant
        self.engine.wake({"kv_cache"})
        return outcome

    # -- requests -------------------------------------------------------------------------------

    def requests(
        self,
        seed: int | None,
        count: int = BATCH,
        max_tokens: int = COMPLETION,
        stop: tuple[int, ...] = (),
    ) -> list[RolloutRequest]:
        """`count` prompts of the task's shortest kind (`BOS d SEP`), sampled alike."""
        return [
            RolloutRequest(f"r{i}", (BOS, i % DIGITS, SEP), sampling(seed, max_tokens, stop))
            for i in range(count)
        ]

    def prompts_of_three_lengths(
        self, seed: int, stop: tuple[int, ...], count: int = 6
    ) -> list[RolloutRequest]:
        """The task's prompts (`BOS d.. SEP`, the digit once to three times), their lengths
        taking turns in one batch."""
        return [
            RolloutRequest(
                f"p{i}",
                (BOS, *(i % DIGITS,) * (1 + i % PROMPT_DIGITS), SEP),
                sampling(seed, COMPLETION, stop),
            )
            for i in range(count)
        ]

    def long_generate(self) -> list[RolloutRequest]:
        """The most work one generate may hold."""
        return self.requests(seed=1, count=self.most_requests, max_tokens=self.longest)

    def unfinished(self) -> int:
        """Requests still running inside the engine (after a generate returned or raised)."""
        return 0

    def model_eos(self) -> frozenset[int]:
        """The EOS ids the engine reads from its model directory, which it would add to a
        request's stop tokens of its own (none: it reads no such directory)."""
        return frozenset()

    # -- memory ---------------------------------------------------------------------------------

    def witness(self) -> Witness:
        raise NotImplementedError

    # -- ending ---------------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self.channel.close_sender()
            self.inlet.close()
            self.engine.close()
        finally:
            self.channel.close()


class SimulatedHarness(RolloutHarness):
    kind = "simulated"
    case = "simulated"
    logprob_tolerance = 0.0
    loader_name = "simulated rollout"

    def __init__(self) -> None:
        super().__init__(simulated_job())
        sizes = self.spec.settings("simulated", SimulatedSpec).sizes
        self.ledger = DeviceLedger(self.store, sizes.device_mb)

    def trainer_spec(self, variant: int) -> EngineSpec:
        return self.spec

    def trained(self, trainer: TrainerEngine, variant: int) -> TrainerEngine:
        for _ in range(variant):  # the simulated trainer's weights follow its step
            trainer.train_step([])
        return trainer

    def witness(self) -> Witness:
        """The job store's ledger of device 0, the device this rank's engine holds."""
        return DeviceInUse(self.ledger, 0)


class TorchRefHarness(RolloutHarness):
    kind = "torch_ref"
    case = "torch_ref"
    longest = KV_CACHE_LEN - 3
    loader_name = "torch_ref rollout"

    def __init__(self) -> None:
        super().__init__(causal_lm_job(self.kind))

    def trainer_spec(self, variant: int) -> EngineSpec:
        return causal_lm_job(self.kind, seed=variant)

    def witness(self) -> Witness:
        """The storages of its model's parameters and of its KV cache, weakly held."""
        engine = self.engine
        assert isinstance(engine, TorchRefRollout)
        tensors: list[torch.Tensor] = []
        if engine.model is not None:
            tensors += engine.model.parameters()
        if engine.cache is not None:
            tensors += [engine.cache.keys, engine.cache.values]
        return Storages(tensors)


class VllmHarness(RolloutHarness):
    kind = "vllm"
    case = "vllm"
    tensor_parallel = 1
    most_requests = 64
    longest = 60  # max_model_len 64, less the prompt
    loader_name = "vLLM's loader of LlamaForCausalLM"

    def __init__(self) -> None:
        job = causal_lm_job(self.kind, tensor_parallel=self.tensor_parallel)
        super().__init__(job, call_timeout_s=VLLM_CALL_TIMEOUT_S)

    def trainer_spec(self, variant: int) -> EngineSpec:
        return causal_lm_job(self.kind, seed=variant, tensor_parallel=self.tensor_parallel)

    def unfinished(self) -> int:
        from timeshare.engines.vllm.engine import VllmRollout  # (imports vLLM: only here)

        engine = self.engine
        assert isinstance(engine, VllmRollout)
        count: int = engine.llm.llm_engine.get_num_unfinished_requests()
        return count

    def model_eos(self) -> frozenset[int]:
        """The EOS of the model's generation config (config.json's where it has none), which
        vLLM merges into a request's stop tokens unless `ignore_eos`."""
        from timeshare.engines.vllm.engine import VllmRollout  # (imports vLLM: only here)

        engine = self.engine
        assert isinstance(engine, VllmRollout)
        config = engine.llm.llm_engine.model_config.try_get_generation_config()
        return _ids(config.get("eos_token_id"))

    def witness(self) -> Witness:
        # Reached only where vLLM has sleep mode (CUDA): this suite runs vLLM's CPU build.
        raise AssertionError("no independent view of vLLM's device memory here")

    def close(self) -> None:
        try:
            super().close()
        finally:
            stop_resource_tracker_when_alone()
        assert child_pids() <= self.children_before  # every process of this engine is gone


class VllmTp2Harness(VllmHarness):
    """vLLM with two tensor-parallel workers: each loads every version, the weight channel
    sends each bucket once into staging both map."""

    case = "vllm:tp2"
    tensor_parallel = 2


class SglangHarness(RolloutHarness):
    kind = "sglang"
    case = "sglang"
    tensor_parallel = 1
    most_requests = 64
    longest = 56  # what SGLang takes of the model's 64 positions (59), less the prompt
    loader_name = "SGLang's loader of LlamaForCausalLM"

    def __init__(self) -> None:
        job = causal_lm_job(self.kind, tensor_parallel=self.tensor_parallel)
        super().__init__(job, call_timeout_s=SGLANG_CALL_TIMEOUT_S)

    def trainer_spec(self, variant: int) -> EngineSpec:
        return causal_lm_job(self.kind, seed=variant, tensor_parallel=self.tensor_parallel)

    def unfinished(self) -> int:
        """Requests SGLang's tokenizer manager still tracks."""
        from timeshare.engines.sglang.engine import SglangRollout  # (SGLang itself: not here)

        engine = self.engine
        assert isinstance(engine, SglangRollout)
        return len(engine.sgl.tokenizer_manager.rid_to_state)

    def model_eos(self) -> frozenset[int]:
        """config.json's EOS with generation_config.json's, which SGLang stops every request
        at (unless request_stops.py keeps it to the request's own)."""
        from timeshare.engines.sglang.engine import SglangRollout  # (SGLang itself: not here)

        engine = self.engine
        assert isinstance(engine, SglangRollout)
        return _ids(engine.sgl.tokenizer_manager.model_config.hf_eos_token_id)

    def witness(self) -> Witness:
        # Reached only where torch_memory_saver frees memory (CUDA): not this CPU.
        raise AssertionError("no independent view of SGLang's device memory here")

    def close(self) -> None:
        try:
            super().close()
        finally:
            stop_resource_tracker_when_alone()
        assert child_pids() <= self.children_before  # every process of this engine is gone


class SglangTp2Harness(SglangHarness):
    """SGLang with two tensor-parallel ranks: each rank's scheduler loads every version."""

    case = "sglang:tp2"
    tensor_parallel = 2


def _ids(value: object) -> frozenset[int]:
    """Token ids as a model's config gives them: one, several, or none."""
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    assert isinstance(value, (list, tuple, set, frozenset)), value
    return frozenset(int(v) for v in value)


HARNESSES: dict[str, Callable[[], RolloutHarness]] = {
    "simulated": SimulatedHarness,
    "torch_ref": TorchRefHarness,
    "vllm": VllmHarness,
    "vllm:tp2": VllmTp2Harness,
    "sglang": SglangHarness,
    "sglang:tp2": SglangTp2Harness,
}
