"""What a builder is given to build one engine of one rank (registry.py names the builders).

    trainer builder:  EngineContext -> TrainerEngine
    rollout builder:  EngineContext -> RolloutEngine

Every builder reads its own settings from `spec` (`spec.settings(name, ItsSpec)`) and the job's
shared ones (`spec.task`, `spec.grpo`); a rollout engine that builds its own copy of the model
asks `spec.trained_model()`, never the trainer's settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from timeshare.engines.handoff import (
    CALL_TIMEOUT_S,
    COLLECTIVE_TIMEOUT_S,
    GENERATE_TIMEOUT_S,
    KEEP_CHECKPOINTS,
)
from timeshare.engines.spec import EngineSpec
from timeshare.protocols.store import JobStore


@dataclass(frozen=True)
class EngineContext:
    spec: EngineSpec
    rank: int
    world_size: int
    store: JobStore
    # The trainers' process group (data-parallel engines): each collective's deadline.
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    # An engine of processes of its own (vLLM): each call into them, and where what they leave
    # is recorded so that a sweep removes it.
    call_timeout_s: float = CALL_TIMEOUT_S
    runtime_dir: Path = Path()
    # A rollout's generate, unless its own settings give one (inside ROLLOUT's deadline).
    generate_timeout_s: float = GENERATE_TIMEOUT_S
    # A checkpoint written by more ranks may be resumed, resharded ([cluster] min_nodes).
    resume_on_fewer_ranks: bool = False
    keep_checkpoints: int = KEEP_CHECKPOINTS
    # The run's directory (the rollout writes samples.jsonl and reward_errors.jsonl there;
    # None: nowhere) and how many samples of each step it writes.
    run_dir: Path | None = None
    samples_per_step: int = 0
