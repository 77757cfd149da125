"""On CUDA, `[engine] batch_invariant` reaches vLLM: its check accepts it there, and every
process of the engine starts with vLLM's batch-invariant kernels asked for (run where a GPU
is, with vLLM's CUDA build: `pytest -m gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.vllm.conftest import MODEL, SPEC
from timeshare.engines.vllm.args import check_engine_args
from timeshare.engines.vllm.engine import VllmRollout
from timeshare.engines.vllm.spec import BATCH_INVARIANT_ENV


@pytest.mark.gpu
@pytest.mark.slow
def test_the_switch_is_accepted_and_reaches_every_process_of_the_engine(tmp_path: Path) -> None:
    check_engine_args(SPEC, MODEL, batch_invariant=True)  # no ConfigError on CUDA
    rollout = VllmRollout(0, SPEC, MODEL, 300.0, tmp_path, batch_invariant=True)
    try:
        processes = list(rollout._titles)
        assert processes, "no process of vLLM's recorded"
        for pid in processes:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"{BATCH_INVARIANT_ENV}=1".encode() in environ, rollout._titles[pid]
    finally:
        rollout.close()
