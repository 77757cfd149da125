"""The pieces of vLLM tensor parallelism that need no engine: each TP worker's report read and
checked, and where each worker's threads run on a CPU."""

from __future__ import annotations

import pytest

from timeshare.engines.cpu_binding import binding_environment, core_groups
from timeshare.engines.load_report import LoadReport, LoadSeconds
from timeshare.engines.vllm.report import worker_reports
from timeshare.errors import TimeshareError
from timeshare.protocols.weights import TransferReport


def report(worker: int, version: int = 3) -> bytes:
    transfer = TransferReport(version=version, bytes=100, tensors=2, buckets=1, seconds=0.1)
    return LoadReport(
        transfer=transfer, digest=f"d{worker}", call_s=0.2, spent=LoadSeconds(), worker=worker
    ).encode()


def test_every_workers_report_in_order() -> None:
    reports = worker_reports([report(0), report(1)], rank=0, workers=2)
    assert [(r.worker, r.digest) for r in reports] == [(0, "d0"), (1, "d1")]


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ([report(0)], "answered for 1 workers, the engine has 2"),
        ([report(0), None], "TP worker 1 has no report"),
        ([report(1), report(0)], "TP worker 0's place is worker 1's"),
        ([report(0), report(1, version=2)], r"different versions: \[3, 2\]"),
        ([report(0), b"junk"], "of TP worker 1 answered no LoadReport"),
    ],
)
def test_a_missing_or_wrong_report_names_the_worker(answers: list[object], message: str) -> None:
    with pytest.raises(TimeshareError, match=message):
        worker_reports(answers, rank=0, workers=2)


@pytest.mark.parametrize(
    ("cores", "workers", "groups"),
    [
        ([0, 1], 2, [[0], [1]]),
        ([3, 2, 1, 0], 2, [[0, 1], [2, 3]]),
        ([0, 1, 2], 2, [[0, 1], [2]]),
        ([5], 2, [[5], [5]]),
        ([0, 1, 2, 3], 1, [[0, 1, 2, 3]]),
    ],
)
def test_cores_split_into_one_group_per_worker(
    cores: list[int], workers: int, groups: list[list[int]]
) -> None:
    assert core_groups(cores, workers) == groups


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def test_the_binding_is_set_only_for_several_workers_the_user_left_unbound() -> None:
    assert binding_environment(BIND_ENV, 2, [0, 1, 2, 3], {}) == {BIND_ENV: "0,1|2,3"}
    assert binding_environment(BIND_ENV, 1, [0, 1], {}) == {}  # the engine's own default
    assert binding_environment(BIND_ENV, 2, [0, 1], {BIND_ENV: "0|0"}) == {}  # the user's
