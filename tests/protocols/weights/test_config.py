"""TransferConfig refuses values that cannot work, naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from timeshare.errors import ConfigError
from timeshare.protocols.weights import TransferConfig, TransferReport


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_mb": 0}, "bucket_mb must be positive"),
        ({"bucket_mb": 1e-9}, "smaller than 64 bytes"),
        ({"pipeline_depth": 3}, "pipeline_depth must be 1 or 2"),
        ({"pipeline_depth": 0}, "pipeline_depth must be 1 or 2"),
        ({"ack_timeout_s": 0}, "ack_timeout_s must be positive"),
        ({"finalize_timeout_s": -1}, "finalize_timeout_s must be positive"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s must be positive"),
        ({"ack_timeout_s": 30, "begin_timeout_s": 10}, "begin_timeout_s .* must not be shorter"),
        ({"linger_s": -1}, "linger_s must not be negative"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TransferConfig(**kwargs)


def test_bucket_bytes_are_aligned() -> None:
    assert TransferConfig(bucket_mb=64).bucket_bytes == 64 * 2**20
    assert TransferConfig(bucket_mb=0.001).bucket_bytes % 64 == 0


def test_report_bandwidth() -> None:
    assert (
        TransferReport(version=1, bytes=2_000_000_000, tensors=1, buckets=1, seconds=2.0).gbps
        == 1.0
    )
    assert TransferReport(version=1, bytes=0, tensors=0, buckets=0, seconds=0.0).gbps == 0.0
