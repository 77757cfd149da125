"""TransferConfig refuses values that cannot work, naming the key, at construction."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from timeshare.config import load_config
from timeshare.errors import ConfigError
from timeshare.protocols.weights import TransferConfig, TransferReport
from timeshare.protocols.weights.config import DEADLINES

NOT_FINITE = [math.inf, -math.inf, math.nan]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_mb": 0}, "bucket_mb must be"),
        ({"bucket_mb": 1e-9}, "smaller than 64 bytes"),
        ({"pipeline_depth": 3}, "pipeline_depth must be 1 or 2"),
        ({"pipeline_depth": 0}, "pipeline_depth must be 1 or 2"),
        ({"ack_timeout_s": 0}, "ack_timeout_s must be"),
        ({"finalize_timeout_s": -1}, "finalize_timeout_s must be"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s must be"),
        ({"ack_timeout_s": 30, "begin_timeout_s": 10}, "begin_timeout_s .* must not be shorter"),
        ({"linger_s": -1}, "linger_s must be"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TransferConfig(**kwargs)


@pytest.mark.parametrize("value", NOT_FINITE, ids=str)
@pytest.mark.parametrize("key", ["bucket_mb", "linger_s", *DEADLINES])
def test_non_finite_values_are_refused_naming_the_key(key: str, value: Any) -> None:
    # Issue 11, defects 2-4: inf/NaN once got through, then failed deep inside with an
    # OverflowError or ValueError (or made every receive fail at once).
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number") as info:
        TransferConfig(**{key: value})
    assert str(value) in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("bucket_mb", 1e12),  # more than 64 GiB per staging buffer
        ("linger_s", 1e7),  # zmq's linger is an int of milliseconds; a close must not block long
        ("linger_s", 61.0),
        ("begin_timeout_s", 1e9),  # longer than a week is no deadline
        ("ack_timeout_s", 1e9),
    ],
)
def test_huge_values_are_refused_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"^{key} must be at most"):
        TransferConfig(**{key: value})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("bucket_mb", "64", "bucket_mb must be a number, got '64'"),
        ("bucket_mb", True, "bucket_mb must be a number, got True"),
        ("pipeline_depth", 2.0, "pipeline_depth must be an int, got 2.0"),
        ("pipeline_depth", True, "pipeline_depth must be an int, got True"),
        ("checksum", "yes", "checksum must be true or false, got 'yes'"),
        ("transport", "nvlink", "transport must be one of 'auto', 'shm', 'cuda_ipc', got 'nvlink'"),
    ],
)
def test_values_of_the_wrong_type_are_refused_naming_the_key(
    key: str, value: Any, message: str
) -> None:
    # Built in code (a TOML file is type-checked by msgspec before this), so checked here.
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        TransferConfig(**{key: value})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[transfer]\nbucket_mb = inf", r"transfer: bucket_mb must be a finite number, got inf"),
        ("[transfer]\nlinger_s = nan", r"transfer: linger_s must be a finite number, got nan"),
        ("[transfer]\nbegin_timeout_s = nan", "transfer: begin_timeout_s must be a finite"),
        ("[deadlines]\nphase_s = inf", r"deadlines.phase_s: Expected `float` <= 604800"),
        ("[deadlines.commands]\nsync = inf", r"deadlines.commands: Expected `float` <= 604800"),
    ],
)
def test_the_config_file_gets_the_same_errors(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path, environ={})
    assert str(path) in str(info.value)


def test_bucket_bytes_are_aligned() -> None:
    assert TransferConfig(bucket_mb=64).bucket_bytes == 64 * 2**20
    assert TransferConfig(bucket_mb=0.001).bucket_bytes % 64 == 0


def test_report_bandwidth() -> None:
    assert (
        TransferReport(version=1, bytes=2_000_000_000, tensors=1, buckets=1, seconds=2.0).gbps
        == 1.0
    )
    assert TransferReport(version=1, bytes=0, tensors=0, buckets=0, seconds=0.0).gbps == 0.0


def test_a_runtime_dir_too_long_for_the_session_sockets_is_refused(tmp_path: Path) -> None:
    # w-rank1.sock.<8 hex> must fit in 107 bytes: 74 bytes of directory leave room, 90 do not.
    path = tmp_path / "job.toml"
    fits = "/tmp/" + "d" * 69
    path.write_text(f'[job]\nranks = 2\nruntime_dir = "{fits}"\n')
    assert load_config(path, environ={}).config.job.runtime_dir == fits
    path.write_text(f'[job]\nranks = 2\nruntime_dir = "{fits + "d" * 16}"\n')
    with pytest.raises(ConfigError, match=r"^job.runtime_dir is too long \(from file .*"):
        load_config(path, environ={})
