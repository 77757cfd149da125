"""The longest sequence the task makes (max_prompt_tokens + max_completion_tokens) is checked at
config load against what the rollout engine holds: its longest sequence and its KV cache."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engines.contract.rollouts import MODEL
from timeshare.engines.spec import (
    EngineChoice,
    check_engines,
    check_rollout_holds_a_sequence,
    engine_spec,
)
from timeshare.errors import ConfigError

TASK = {
    "prompts_per_rank": 2,
    "group_size": 4,
    "max_prompt_tokens": 10,
    "max_completion_tokens": 20,
}


def spec_of(rollout: str, **settings: Any) -> EngineChoice:
    return engine_spec(
        trainer="torch_ref",
        rollout=rollout,
        task=TASK,
        torch_ref={"model": MODEL},
        **{rollout: settings},
    )


def job(rollout: str, **settings: Any) -> None:
    """What `timeshare plan` checks (it sizes the KV cache itself)."""
    check_engines(spec_of(rollout, **settings), probe=False)


def kv_cache_of(rollout: str, **settings: Any) -> None:
    """The KV cache's check, as a run's config load makes it (with the engines' probes)."""
    spec = spec_of(rollout, **settings)
    check_rollout_holds_a_sequence(spec, spec.served_model().config, lambda key: "default")


def test_a_sequence_longer_than_vllms_max_model_len_is_refused_naming_both_keys() -> None:
    job("vllm", max_model_len=30)  # 10 + 20: fits
    with pytest.raises(ConfigError, match=r"engine\.vllm\.max_model_len \(29, from default\)"):
        job("vllm", max_model_len=29)
    with pytest.raises(ConfigError, match=r"max_prompt_tokens \(10\) plus .*max_completion_tokens"):
        job("vllm", max_model_len=29)


def test_a_kv_cache_smaller_than_a_sequence_is_refused_naming_its_key() -> None:
    # a token takes 2 (K, V) x 2 layers x 2 kv heads x 32 x 4 bytes (float32) = 1 KiB
    kv_cache_of("vllm", kv_cache_mb=30 / 1024)
    job("vllm", kv_cache_mb=29 / 1024)  # timeshare plan: its own rule says it, on the device
    with pytest.raises(ConfigError, match=r"engine\.vllm\.kv_cache_mb .*holds 29 tokens"):
        kv_cache_of("vllm", kv_cache_mb=29 / 1024)
    with pytest.raises(ConfigError, match=r"engine\.sglang\.max_total_tokens .*holds 16 tokens"):
        kv_cache_of("sglang", max_total_tokens=16)
    with pytest.raises(ConfigError, match=r"engine\.sglang\.context_length \(24"):
        job("sglang", context_length=24)
