"""On CUDA, `[engine] batch_invariant` reaches SGLang: its check accepts it there with an
attention backend that takes SGLang's deterministic inference, and refuses torch_native (the
default, what SGLang's CPU engine runs) naming the key and what to set; the engine runs with
deterministic inference (run where a GPU is, from SGLang's CUDA venv: `pytest -m "gpu and
sglang"`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.sglang.conftest import MODEL, SPEC, spec
from timeshare.engines.sglang.args import check_server_args
from timeshare.engines.sglang.engine import SglangRollout
from timeshare.errors import ConfigError

DETERMINISTIC = spec(attention_backend="triton")  # (Triton's kernels: any CUDA device)


@pytest.mark.gpu
def test_the_switch_runs_sglang_with_deterministic_inference(tmp_path: Path) -> None:
    check_server_args(DETERMINISTIC, MODEL, batch_invariant=True)  # no ConfigError on CUDA
    rollout = SglangRollout(0, DETERMINISTIC, MODEL, 300.0, tmp_path, batch_invariant=True)
    try:
        assert rollout.sgl.server_args.enable_deterministic_inference is True
        assert rollout.sgl.server_args.attention_backend == "triton"
    finally:
        rollout.close()


@pytest.mark.gpu
def test_the_switch_with_torch_native_on_cuda_is_refused_naming_the_backend() -> None:
    """device "auto", which is CUDA here: the check's child resolves it as the engine does."""
    assert SPEC.device == "auto" and SPEC.attention_backend == "torch_native"
    refused = (
        r"engine.sglang.attention_backend \('torch_native'\): engine.batch_invariant .* set "
        r"engine.sglang.attention_backend to one it takes on cuda \(.*triton"
    )
    with pytest.raises(ConfigError, match=refused):
        check_server_args(SPEC, MODEL, batch_invariant=True)
