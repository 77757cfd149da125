"""What the two frame codecs share (command lanes, weight channel): decoding that turns a bad
frame into a ProtocolError, and an exception's text cut to fit an error frame."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from timeshare.errors import ProtocolError

# An error frame carries at most this much text, so a huge message cannot flood a channel.
MAX_ERROR_TEXT = 4096
MAX_TYPE_NAME = 200

T = TypeVar("T")


def decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T:
    """`data` decoded by `decoder`; a malformed frame is a ProtocolError naming `what` and its size.

    Malformed covers both bytes that are not msgpack and msgpack of the wrong shape.
    """
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {what} frame ({len(data)} bytes): {exc}") from exc


def error_text(exc: BaseException) -> tuple[str, str]:
    """`exc`'s type name and message, each cut to what an error frame carries."""
    return type(exc).__name__[:MAX_TYPE_NAME], str(exc)[:MAX_ERROR_TEXT]
