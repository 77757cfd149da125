"""With `[engine] batch_invariant` off, a `VLLM_BATCH_INVARIANT=1` the rollout worker inherited
(from the shell that started the daemon, say) does not reach vLLM: built through the registry,
as a worker builds it, the engine's every worker says it runs without batch-invariant kernels.
(Built directly, an engine's processes inherit it: vLLM's worker reads 1 there.)"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.engines.vllm.conftest import SHAPE, SPEC
from timeshare.engines.context import EngineContext
from timeshare.engines.model_dir import init_model_dir
from timeshare.engines.pairs import build_rollout
from timeshare.engines.spec import engine_spec
from timeshare.engines.vllm.engine import VllmRollout
from timeshare.engines.vllm.spec import BATCH_INVARIANT_ENV
from timeshare.protocols.store import JobStore

pytestmark = pytest.mark.slow


def test_an_inherited_switch_is_removed_with_the_switch_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="ts-vllm-", dir="/tmp"))  # short: ipc paths
    threads = torch.get_num_threads()  # (the build sets engine.torch_threads in this process)
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    try:
        model_dir = str(init_model_dir(directory / "model", SHAPE, seed=0))
        spec = engine_spec(
            trainer="torch_ref",
            rollout="vllm",
            batch_invariant=False,
            torch_ref={"model_dir": model_dir},
            vllm={"generate_timeout_s": SPEC.generate_timeout_s},
        )
        context = EngineContext(
            spec=spec,
            rank=0,
            world_size=1,
            store=JobStore.host(),
            call_timeout_s=120.0,
            runtime_dir=directory,
        )
        rollout = build_rollout(context)
        try:
            assert isinstance(rollout, VllmRollout)
            assert rollout.batch_invariant_workers() == [False]
        finally:
            rollout.close()
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(directory, ignore_errors=True)
