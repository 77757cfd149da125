"""What the SGLang tests of this directory share: the model, the channel's settings, the spec.

They run SGLang itself, from .venv-sglang (`make test` runs every `sglang`-marked test there).
"""

from __future__ import annotations

import msgspec
import pytest

from timeshare.engines.model_config import ModelConfig
from timeshare.engines.sglang.spec import SglangSpec
from timeshare.protocols.weights import TransferConfig

MODEL = ModelConfig(
    vocab_size=16,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# Small buckets: a version is several buckets, so a layer straddles two of them.
TRANSFER = TransferConfig(
    bucket_mb=0.05, begin_timeout_s=20.0, ack_timeout_s=20.0, handshake_timeout_s=20.0
)
SPEC = SglangSpec(generate_timeout_s=120.0, max_total_tokens=1024)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engines/sglang/" in str(item.path):
            item.add_marker(pytest.mark.sglang)


def spec(**changes: object) -> SglangSpec:
    return msgspec.structs.replace(SPEC, **changes)
