"""Many transfers leave nothing behind: fds, staging, socket files, threads and RSS stay flat.

Each scenario runs in a fresh interpreter (churn.py), so that RSS is the channel's alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.protocols.weights.churn import Usage

RSS_TOLERANCE = 24 * 2**20
ROOT = Path(__file__).resolve().parents[3]


class Report(msgspec.Struct):
    versions: list[int]
    before: Usage
    after: Usage
    during: Usage | None = None


def churn(scenario: str, runtime_dir: Path) -> Report:
    done = subprocess.run(
        [sys.executable, "-m", "tests.protocols.weights.churn", scenario, str(runtime_dir)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return msgspec.json.decode(done.stdout.splitlines()[-1], type=Report)


def assert_flat(before: Usage, after: Usage) -> None:
    assert after.fds <= before.fds + 2, (before, after)
    assert after.segments <= before.segments, (before, after)
    assert after.sockets == 0, (before, after)
    assert after.shm_maps <= before.shm_maps, (before, after)
    assert after.threads <= before.threads + 2, (before, after)
    assert after.rss - before.rss < RSS_TOLERANCE, (before, after)


@pytest.mark.slow
def test_200_transfers_on_one_session(runtime_dir: Path) -> None:
    report = churn("one-session", runtime_dir)
    before, during = report.before, report.during
    assert report.versions == list(range(210)) and during is not None
    # The open session holds its socket file; everything else must not have grown.
    assert during.fds <= before.fds + 2 and during.segments == before.segments, (before, during)
    assert during.shm_maps <= before.shm_maps, (before, during)
    assert during.rss - before.rss < RSS_TOLERANCE, (before, during)
    assert_flat(before, report.after)


@pytest.mark.slow
def test_50_transfers_with_a_fresh_pair_each(runtime_dir: Path) -> None:
    report = churn("fresh-pairs", runtime_dir)
    assert report.versions == list(range(55))
    assert_flat(report.before, report.after)
