"""On CUDA, `[engine] batch_invariant` reaches SGLang: its check accepts it there (an attention
backend that takes it), and the engine runs with deterministic inference (run where a GPU is,
from SGLang's CUDA venv: `pytest -m "gpu and sglang"`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.sglang.conftest import MODEL, SPEC
from timeshare.engines.sglang.engine import SglangRollout


@pytest.mark.gpu
def test_the_switch_runs_sglang_with_deterministic_inference(tmp_path: Path) -> None:
    rollout = SglangRollout(0, SPEC, MODEL, 300.0, tmp_path, batch_invariant=True)
    try:
        assert rollout.sgl.server_args.enable_deterministic_inference is True
    finally:
        rollout.close()
