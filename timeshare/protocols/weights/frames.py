"""Wire format of the weight channel: typed msgspec Structs encoded as msgpack.

Every frame carries the protocol version and the session id; frames within a transfer carry the
weight version and a sequence number, and every reply repeats them. Requests go from the sender
(REQ) to the receiver (REP); each gets exactly one reply.

On the endpoint both sides were given (the rendezvous; for member k of a session with several
receivers, the endpoint's member k: runtime.Endpoint.member), one request only:

    Invite    -> Ack(step="joined")      the session's own socket; the receiver that answers
                                         leaves the rendezvous and connects there
              -> Failure                 the invitation is stale (its socket is gone): the
                                         receiver stays at the rendezvous for the next one

Then, on the session's socket, to which only the receiver that joined ever connects (so that no
other receiver, not even one of a dead session on the same endpoint, is handed a frame of it):

    Offer     -> Ack(step="mapped")      staging described; receiver maps it
    Bucket    -> Ack(step="bucket")      receiver consumed the bucket and dropped every view
    Bucket(last=totals) -> Ack(step="released")   the last bucket, consumed, and every tensor
                                         of the transfer delivered (saves a round trip)
    Release   -> Ack(step="released")    every tensor delivered; sender may recycle staging
                                         (when the last bucket could not say so)
    Finalize  -> Ack(step="finalized")   receiver's post-processing done, device fenced
    Abort     -> Ack(step="aborted")     sender gave up on this transfer (session ends)
    Goodbye   -> Ack(step="goodbye")     sender closes the session
    any       -> Failure                 receiver failed; names its exception

No pickle: a frame from a peer is data, never code.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from timeshare.errors import ProtocolError
from timeshare.protocols import wire
from timeshare.protocols.weights.descriptions import StagingDescription

PROTOCOL_VERSION = 2  # 2: the session moved to a socket of its own (Invite)


class _Frame(msgspec.Struct, frozen=True, tag_field="kind"):
    """Base of every frame: the "kind" field tells them apart on the wire."""


# A piece's offset in its staging buffer is a multiple of this, so that every dtype view of the
# piece is aligned; the receiver refuses a piece that is not.
ALIGNMENT = 64


class TensorPiece(msgspec.Struct, frozen=True, array_like=True):
    """One tensor, or one part of a tensor larger than a bucket, inside a staging buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset in the staging buffer
    nbytes: int  # bytes of this piece
    start: int  # byte offset of this piece within the whole tensor
    total: int  # bytes of the whole tensor


class Totals(msgspec.Struct, frozen=True, array_like=True):
    """What a whole transfer carried: checked by the receiver before it answers RELEASED."""

    tensors: int
    nbytes: int


class Invite(_Frame, frozen=True, tag="invite", omit_defaults=True):
    """Join session `session` on its own socket: for ipc the file the receiver derives from its
    endpoint and the session id; for tcp `port` on the host the receiver reached (never a host
    of the sender's choosing: it may have bound 0.0.0.0).

    A session may have several receivers (an engine's tensor-parallel workers, each loading its
    own shard from the same staging): the invitation names which `member` of how many
    `members` it is for, and a receiver that was set up as another refuses it. One receiver
    leaves both out (defaults are not encoded): the wire of a single receiver is unchanged.
    """

    protocol: int
    session: int
    port: int = 0  # tcp only
    member: int = 0
    members: int = 1


class Offer(_Frame, frozen=True, tag="offer"):
    protocol: int
    session: int
    staging: StagingDescription


class Bucket(_Frame, frozen=True, tag="bucket"):
    protocol: int
    session: int
    version: int
    seq: int
    index: int  # bucket number within this transfer
    buffer: int  # which staging buffer holds it
    pieces: list[TensorPiece]
    checksum: int | None = None  # crc32 of the bytes used, when enabled
    last: Totals | None = None  # set on the transfer's last bucket: its ACK is RELEASED


class Release(_Frame, frozen=True, tag="release"):
    protocol: int
    session: int
    version: int
    seq: int
    tensors: int
    nbytes: int


class Finalize(_Frame, frozen=True, tag="finalize"):
    protocol: int
    session: int
    version: int
    seq: int


class Abort(_Frame, frozen=True, tag="abort"):
    protocol: int
    session: int
    version: int
    seq: int
    reason: str


class Goodbye(_Frame, frozen=True, tag="goodbye"):
    protocol: int
    session: int


Request = Invite | Offer | Bucket | Release | Finalize | Abort | Goodbye
AckStep = Literal["joined", "mapped", "bucket", "released", "finalized", "aborted", "goodbye"]


class Ack(_Frame, frozen=True, tag="ack"):
    protocol: int
    session: int
    step: AckStep
    version: int
    seq: int


class Failure(_Frame, frozen=True, tag="failure"):
    protocol: int
    session: int
    version: int
    seq: int
    type: str
    message: str


Reply = Ack | Failure

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(frame: Request | Reply) -> bytes:
    return _encoder.encode(frame)


def decode_request(data: bytes) -> Request:
    """Decode a sender's frame; anything malformed or of another protocol is a ProtocolError."""
    frame: Request = _decode(_request_decoder, data, "request")
    _check_protocol(frame.protocol)
    return frame


def decode_reply(data: bytes) -> Reply:
    """Decode a receiver's frame; anything malformed or of another protocol is a ProtocolError."""
    frame: Reply = _decode(_reply_decoder, data, "reply")
    _check_protocol(frame.protocol)
    return frame


def failure_for(exc: BaseException, *, session: int, version: int, seq: int) -> Failure:
    """The error frame that reports `exc` to the peer, its text cut to fit (wire.error_text)."""
    type_name, message = wire.error_text(exc)
    return Failure(
        protocol=PROTOCOL_VERSION,
        session=session,
        version=version,
        seq=seq,
        type=type_name,
        message=message,
    )


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes, what: str) -> Any:
    try:
        return wire.decode(decoder, data, what)
    except ProtocolError as malformed:
        # A frame of another protocol version seldom decodes: name the version, not the shape.
        foreign = _foreign_protocol(data)
        if foreign is None:
            raise
        raise ProtocolError(
            f"peer speaks weight-channel protocol {foreign}, this side {PROTOCOL_VERSION}"
        ) from malformed.__cause__


def _foreign_protocol(data: bytes) -> object | None:
    try:
        loose = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(loose, dict):
        version: object = loose.get("protocol")
        if version is not None and version != PROTOCOL_VERSION:
            return version
    return None


def _check_protocol(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks weight-channel protocol {version}, this side {PROTOCOL_VERSION}"
        )
