"""`timesharectl` without a daemon, and its status table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from timeshare.daemon.ctl import status_table
from timeshare.errors import NoDaemon


def test_no_daemon_is_exit_2_naming_the_socket(tmp_path: Path) -> None:
    missing = tmp_path / "none.sock"
    result = subprocess.run(
        [sys.executable, "-m", "timeshare.daemon.ctl", "--socket", str(missing), "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert f"cannot connect to {missing}" in result.stderr


def test_the_status_table_shows_what_an_operator_asks_first() -> None:
    table = status_table(
        {
            "lifecycle": "running",
            "step": 12,
            "steps": 30,
            "committed_step": 11,
            "weight_version": 11,
            "phases": ["sync", "offload"],
            "uptime_s": 3723.5,
            "engine": "torch_ref",
            "ranks": 2,
            "last_step": {
                "step": 11,
                "phases": {"train": 0.31, "sync": 0.0123},
                "sync": {"bytes": 250_000, "seconds": 0.001, "gbps": 0.25},
                "reward_mean": 0.5,
            },
            "metrics_port": 9464,
            "pid": 42,
        }
    )
    assert "running" in table and "12 of 30" in table and "1h 02m 03s" in table
    assert "sync, offload" in table and "train 310.0 ms  sync 12.3 ms" in table
    assert "0.250 GB/s" in table and "http://127.0.0.1:9464/metrics" in table
    assert len(table.splitlines()) == 12


def test_the_status_table_shows_memory_a_rollout_engine_cannot_release() -> None:
    last = {"step": 3, "phases": {}, "sync": {"gbps": 0.1}, "rollout_resident_mb": 133.7}
    table = status_table({"lifecycle": "running", "last_step": last, "pid": 1})
    assert "resident while asleep" in table and "133.7 MiB" in table
    released = status_table(
        {"lifecycle": "running", "last_step": {**last, "rollout_resident_mb": 0.0}}
    )
    assert "resident" not in released


def test_the_status_table_shows_what_each_rank_sent_and_each_tp_worker_loaded() -> None:
    last = {
        "step": 3,
        "phases": {},
        "sync": {"gbps": 0.1},
        "per_rank": [
            {"rank": 0, "sent_bytes": 3 << 20, "loaded_bytes": [3 << 20, 3 << 20]},
            {"rank": 1, "sent_bytes": 0, "loaded_bytes": []},
        ],
    }
    table = status_table({"lifecycle": "running", "last_step": last, "pid": 1})
    assert "rank 0: sent 3.00 MiB, loaded 3.00 MiB / 3.00 MiB by 2 TP workers" in table
    assert "rank 1: sent 0.00 MiB" in table


def test_a_status_field_of_the_wrong_type_is_not_understood_naming_it() -> None:
    with pytest.raises(NoDaemon, match=r"status was not understood.*\$\.steps"):
        status_table({"lifecycle": "running", "steps": "thirty"})
    with pytest.raises(NoDaemon, match=r"last step was not understood.*\$\.phases"):
        status_table({"lifecycle": "running", "last_step": {"step": 3, "phases": {"train": "x"}}})
