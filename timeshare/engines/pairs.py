"""The trainer and the rollout engine of one rank, built as the registry says, and what the
rollout serves.

Nothing here names an engine: `[engine] trainer` and `rollout` are looked up in the registry
(registry.py), whose builder is imported only now, in the worker that runs it.
"""

from __future__ import annotations

import torch

from timeshare.engines import registry
from timeshare.engines.base import RolloutEngine, TrainerEngine
from timeshare.engines.context import EngineContext
from timeshare.engines.invariance import remove_inherited_switches
from timeshare.engines.task import Workload, workload


def build_trainer(context: EngineContext) -> TrainerEngine:
    engine = _built(context, context.spec.trainer, "trainer")
    if not isinstance(engine, TrainerEngine):
        raise TypeError(f"the trainer builder of {context.spec.trainer} made a {engine!r}")
    return engine


def build_rollout(context: EngineContext) -> RolloutEngine:
    engine = _built(context, context.spec.rollout, "rollout")
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"the rollout builder of {context.spec.rollout} made a {engine!r}")
    return engine


def workload_of(context: EngineContext) -> Workload:
    """What the rank's rollout serves: the task, or (simulated engines) fixed requests."""
    spec = context.spec
    return workload(
        registry.find(spec.rollout, "rollout").family,
        spec,
        ranks=context.world_size,
        run_dir=context.run_dir,
        samples_per_step=context.samples_per_step,
    )


def _built(context: EngineContext, name: str, role: registry.Role) -> object:
    # `[engine] batch_invariant` alone turns the mode on: the engine sets what it needs, none
    # inherited stays (invariance.py)
    remove_inherited_switches()
    torch.set_num_threads(context.spec.torch_threads)
    engine: object = registry.find(name, role).builder(role)(context)
    return engine
