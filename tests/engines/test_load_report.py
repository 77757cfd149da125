"""An engine process's report of a version as it crosses to the rollout worker: msgpack bytes,
typed again on arrival."""

from __future__ import annotations

import msgspec
import pytest

from timeshare.engines.load_report import LoadReport, LoadSeconds
from timeshare.errors import TimeshareError
from timeshare.protocols.weights import TransferReport
from timeshare.timing import Span


def test_a_load_report_arrives_as_it_left() -> None:
    transfer = TransferReport(
        version=4,
        bytes=1 << 20,
        tensors=9,
        buckets=2,
        seconds=0.125,
        spans=(Span("load 0", 5.0, 0.05), Span("load 1", 5.05, 0.05), Span("finalize", 5.1, 0.02)),
    )
    spent = LoadSeconds(digest_s=0.01, copy_s=0.02, load_s=0.03, finalize_s=0.02)
    report = LoadReport(transfer=transfer, digest="cd" * 16, call_s=0.2, spent=spent)
    data = report.encode()
    assert isinstance(data, bytes)
    got = LoadReport.decode(data, "the test")
    assert got == report
    assert got.transfer == transfer and all(isinstance(s, Span) for s in got.transfer.spans)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ({"transfer": {}}, "not bytes"),  # a dict: not what the backend sends
        (b"\xc1", "the test answered no LoadReport"),  # not msgpack
        (
            msgspec.msgpack.encode({"digest": "ab"}),
            "the test answered no LoadReport",
        ),  # the wrong shape
    ],
)
def test_anything_else_is_a_timeshare_error(answer: object, match: str) -> None:
    with pytest.raises(TimeshareError, match=match):
        LoadReport.decode(answer, "the test")
