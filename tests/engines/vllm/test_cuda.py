"""On CUDA, `[engine] batch_invariant` reaches vLLM: its check accepts it there, and every
worker of the engine runs vLLM's batch-invariant kernels, as each says (run where a GPU is,
with vLLM's CUDA build: `pytest -m gpu`).

Each worker is asked what vLLM read there (`VLLM_BATCH_INVARIANT`, through the worker
extension, by method name): `/proc/<pid>/environ` would not do, since a process vLLM forks
shows there the environment its parent was exec'd with, not the one it runs with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.vllm.conftest import MODEL, SPEC
from timeshare.engines.vllm.args import check_engine_args
from timeshare.engines.vllm.engine import VllmRollout


@pytest.mark.gpu
@pytest.mark.slow
def test_the_switch_is_accepted_and_reaches_every_worker_of_the_engine(tmp_path: Path) -> None:
    check_engine_args(SPEC, MODEL, batch_invariant=True)  # no ConfigError on CUDA
    rollout = VllmRollout(0, SPEC, MODEL, 300.0, tmp_path, batch_invariant=True)
    try:
        assert rollout.batch_invariant_workers() == [True] * SPEC.tensor_parallel_size
    finally:
        rollout.close()
