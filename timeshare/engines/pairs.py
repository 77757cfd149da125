"""The engine pairs a job can run, and each pair's workload (the requests and their rewards).

`EnginePair` builds, for one rank, the trainer or the rollout engine the `[engine]` section
names, and the workload the rollout side serves: the simulated pair samples fixed requests with
no reward; the reference pair samples the shipped task's prompts, `group_size` times each, and
scores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from timeshare.engines.base import (
    RolloutEngine,
    RolloutRequest,
    RolloutSample,
    SamplingParams,
    TrainerEngine,
)
from timeshare.engines.simulated import DeviceLedger, SimulatedRollout, SimulatedTrainer
from timeshare.engines.spec import EngineSpec, rollout_vllm_spec, served_model
from timeshare.engines.torch_ref.rollout import TorchRefRollout
from timeshare.engines.torch_ref.spec import TorchRefSpec
from timeshare.engines.torch_ref.task import RepeatDigit, sampling_seed
from timeshare.engines.torch_ref.trainer import TorchRefTrainer
from timeshare.protocols.store import JobStore

SIMULATED_REQUESTS = 4


class Workload(Protocol):
    def requests(self, rank: int, step: int) -> list[RolloutRequest]: ...

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None: ...


class SimulatedWorkload:
    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        sampling = SamplingParams(max_tokens=4)
        return [
            RolloutRequest(f"r{rank}-{i}", (1, 2, 3), sampling) for i in range(SIMULATED_REQUESTS)
        ]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return None


@dataclass(frozen=True)
class TaskWorkload:
    """The shipped task: each prompt `group_size` times, seeded by (seed, rank, step)."""

    spec: TorchRefSpec

    def requests(self, rank: int, step: int) -> list[RolloutRequest]:
        task = self.task
        sampling = SamplingParams(
            max_tokens=self.spec.completion_tokens,
            temperature=self.spec.temperature,
            top_p=self.spec.top_p,
            seed=sampling_seed(self.spec.seed, rank, step),
        )
        prompts = task.prompts(self.spec.seed, rank, step, self.spec.prompts_per_rank)
        return [
            RolloutRequest(f"s{step}-r{rank}-p{p}-g{g}", prompt, sampling)
            for p, prompt in enumerate(prompts)
            for g in range(self.spec.group_size)
        ]

    def score(self, request: RolloutRequest, sample: RolloutSample) -> float | None:
        return self.task.reward(request.prompt_tokens, sample.tokens)

    @property
    def task(self) -> RepeatDigit:
        return RepeatDigit(self.spec.completion_tokens)


@dataclass(frozen=True)
class EnginePair:
    spec: EngineSpec
    rank: int
    world_size: int
    store: JobStore

    def trainer(self, collective_timeout_s: float) -> TrainerEngine:
        if self.spec.trainer == "fsdp":
            from timeshare.engines.fsdp.trainer import FsdpTrainer  # noqa: PLC0415 - transformers only where used

            torch.set_num_threads(self.spec.torch_ref.torch_threads)
            return FsdpTrainer(
                self.rank,
                self.world_size,
                self.spec.fsdp,
                self.spec.torch_ref,
                store=self.store,
                collective_timeout_s=collective_timeout_s,
            )
        if self.spec.kind == "torch_ref":
            torch.set_num_threads(self.spec.torch_ref.torch_threads)
            return TorchRefTrainer(
                self.rank,
                self.world_size,
                self.spec.torch_ref,
                store=self.store,
                collective_timeout_s=collective_timeout_s,
            )
        return SimulatedTrainer(self.rank, self.spec.simulated, self._ledger())

    def rollout(self, call_timeout_s: float, runtime_dir: Path) -> RolloutEngine:
        """The rollout engine. For an engine of its own processes (vLLM): `call_timeout_s`
        bounds each call into them, `runtime_dir` is where what they leave is recorded."""
        if self.spec.rollout == "vllm":
            from timeshare.engines.vllm.engine import VllmRollout  # noqa: PLC0415 - vLLM only where used

            torch.set_num_threads(self.spec.torch_ref.torch_threads)
            return VllmRollout(
                self.rank,
                rollout_vllm_spec(self.spec),
                served_model(self.spec),
                call_timeout_s,
                runtime_dir,
            )
        if self.spec.kind == "torch_ref":
            torch.set_num_threads(self.spec.torch_ref.torch_threads)
            return TorchRefRollout(self.rank, self.spec.torch_ref, served_model(self.spec))
        return SimulatedRollout(self.rank, self.spec.simulated, self._ledger())

    def workload(self) -> Workload:
        if self.spec.kind == "torch_ref":
            return TaskWorkload(self.spec.torch_ref)
        return SimulatedWorkload()

    def _ledger(self) -> DeviceLedger:
        sizes = self.spec.simulated.sizes
        return DeviceLedger(self.store, sizes.device_mb, enabled=self.spec.simulated.account_memory)
