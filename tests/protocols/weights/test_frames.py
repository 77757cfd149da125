"""Wire frames: round trips, and every malformed or foreign frame is a ProtocolError."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from timeshare.errors import ProtocolError
from timeshare.protocols.weights import frames
from timeshare.protocols.weights.descriptions import ShmSegments
from timeshare.protocols.weights.frames import PROTOCOL_VERSION, TensorPiece
from timeshare.protocols.wire import MAX_ERROR_TEXT

SAMPLES: list[frames.Request | frames.Reply] = [
    frames.Invite(PROTOCOL_VERSION, 5),
    frames.Invite(PROTOCOL_VERSION, 5, port=40123),
    frames.Offer(PROTOCOL_VERSION, 5, ShmSegments(names=["ts-w-x-1-2-3-0"], buffer_bytes=4096)),
    frames.Bucket(
        PROTOCOL_VERSION, 5, 7, 1, 0, 1, [TensorPiece("w", "bfloat16", (2, 3), 0, 12, 0, 12)], 99
    ),
    frames.Release(PROTOCOL_VERSION, 5, 7, 2, 1, 12),
    frames.Finalize(PROTOCOL_VERSION, 5, 7, 3),
    frames.Abort(PROTOCOL_VERSION, 5, 7, 4, "bad input"),
    frames.Goodbye(PROTOCOL_VERSION, 5),
    frames.Ack(PROTOCOL_VERSION, 5, "bucket", 7, 1),
    frames.Failure(PROTOCOL_VERSION, 5, 7, 1, "RuntimeError", "boom"),
]


@pytest.mark.parametrize("frame", SAMPLES, ids=lambda f: type(f).__name__)
def test_frames_round_trip(frame: frames.Request | frames.Reply) -> None:
    data = frames.encode(frame)
    decoded = (
        frames.decode_reply(data)
        if isinstance(frame, frames.Ack | frames.Failure)
        else frames.decode_request(data)
    )
    assert decoded == frame


def test_a_reply_is_not_a_request_and_back() -> None:
    with pytest.raises(ProtocolError, match="malformed request frame"):
        frames.decode_request(frames.encode(frames.Ack(PROTOCOL_VERSION, 1, "bucket", 0, 1)))
    with pytest.raises(ProtocolError, match="malformed reply frame"):
        frames.decode_reply(frames.encode(frames.Finalize(PROTOCOL_VERSION, 1, 0, 1)))


def test_another_protocol_version_is_named() -> None:
    future = {"kind": "goodbye", "protocol": PROTOCOL_VERSION + 1, "session": 1, "new": True}
    with pytest.raises(ProtocolError, match=f"protocol 3, this side {PROTOCOL_VERSION}"):
        frames.decode_request(msgspec.msgpack.encode(future))
    with pytest.raises(ProtocolError, match=f"protocol 1, this side {PROTOCOL_VERSION}"):
        frames.decode_reply(frames.encode(frames.Ack(1, 1, "bucket", 0, 1)))


def test_pickle_is_not_a_frame() -> None:
    import pickle

    with pytest.raises(ProtocolError):
        frames.decode_request(pickle.dumps({"kind": "goodbye", "protocol": 1, "session": 1}))


def test_error_text_is_bounded() -> None:
    failure = frames.failure_for(RuntimeError("x" * 100_000), session=1, version=2, seq=3)
    assert failure.type == "RuntimeError"
    assert len(failure.message) == MAX_ERROR_TEXT


@given(st.binary(max_size=512))
def test_random_bytes_are_a_protocol_error_or_a_frame(data: bytes) -> None:
    for decode in (frames.decode_request, frames.decode_reply):
        with contextlib.suppress(ProtocolError):
            decode(data)
