"""Worker results as the driver gets them: a Result frame, its value decoded by `result_type`."""

from __future__ import annotations

import msgspec
import pytest

from timeshare.protocols.commands import frames
from timeshare.protocols.commands.results import CommandResult, SyncResult, result_type
from timeshare.protocols.weights import TransferReport
from timeshare.timing import Span


def through_the_lane(value: CommandResult, command: str, role: str) -> CommandResult:
    """`value` as a worker sends it and the driver decodes it (driver_side.call)."""
    frame = frames.decode_from_worker(frames.encode(frames.result(7, value)))
    assert isinstance(frame, frames.Result) and frame.id == 7
    return msgspec.msgpack.decode(frame.value, type=result_type(command, role))


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_a_sync_result_arrives_with_its_transfer_report_typed(role: str) -> None:
    transfer = TransferReport(
        version=3,
        bytes=3 << 20,
        tensors=5,
        buckets=3,
        seconds=0.25,
        checksummed=3,
        ack_seconds=(0.01, 0.02, 0.03),
    )
    sent = SyncResult(
        engine_s=0.3,
        spans=(Span("sync", 10.0, 0.3), Span("pack 0", 10.1, 0.05)),
        transfer=transfer,
        digest="ab" * 16,
        staging_buffers=2 if role == "trainer" else None,
    )
    got = through_the_lane(sent, "sync", role)
    assert got == sent
    assert isinstance(got, SyncResult) and isinstance(got.transfer, TransferReport)
    assert got.transfer.ack_seconds == (0.01, 0.02, 0.03)
    assert got.transfer.gbps == transfer.gbps
    assert all(isinstance(span, Span) for span in got.spans)


def test_a_transfer_report_keeps_its_spans_through_msgpack() -> None:
    """The vLLM backend's report carries the receiver's spans (engines/vllm/report.py)."""
    report = TransferReport(1, 4096, 2, 1, 0.5, spans=(Span("load 0", 1.0, 0.25),))
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=TransferReport)
    assert got == report and isinstance(got.spans[0], Span)


def test_a_sync_result_without_its_transfer_report_is_refused() -> None:
    flat = {"version": 3, "bytes": 1, "tensors": 1, "buckets": 1, "seconds": 0.1}
    with pytest.raises(msgspec.ValidationError, match="transfer"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(flat), type=result_type("sync", "trainer"))
