"""The helpers both frame codecs share: bad frames become ProtocolError, error text is bounded."""

from __future__ import annotations

import msgspec
import pytest

from timeshare.errors import ProtocolError
from timeshare.protocols import wire
from timeshare.protocols.commands import frames as command_frames


class Point(msgspec.Struct):
    x: int


DECODER = msgspec.msgpack.Decoder(Point)


def test_a_frame_decodes() -> None:
    assert wire.decode(DECODER, msgspec.msgpack.encode(Point(3)), "point") == Point(3)


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"\xc1", msgspec.DecodeError),  # not msgpack at all
        (msgspec.msgpack.encode({"x": "three"}), msgspec.ValidationError),  # the wrong shape
    ],
)
def test_a_bad_frame_is_a_protocol_error_naming_what_and_its_size(
    data: bytes, cause: type[Exception]
) -> None:
    expected = rf"^malformed point frame \({len(data)} bytes\): "
    with pytest.raises(ProtocolError, match=expected) as raised:
        wire.decode(DECODER, data, "point")
    assert isinstance(raised.value.__cause__, cause)


def test_error_text_cuts_type_name_and_message() -> None:
    long_name = type("E" * 500, (Exception,), {})
    type_name, message = wire.error_text(long_name("m" * 100_000))
    assert type_name == "E" * wire.MAX_TYPE_NAME
    assert message == "m" * wire.MAX_ERROR_TEXT
    assert wire.error_text(ValueError("short")) == ("ValueError", "short")


def test_a_command_failure_frame_is_bounded() -> None:
    failure = command_frames.failure(7, RuntimeError("x" * 100_000))
    assert (failure.id, failure.type) == (7, "RuntimeError")
    assert len(failure.message) == wire.MAX_ERROR_TEXT
