"""Wire format of the command lanes: typed msgspec Structs as msgpack, never pickle.

Driver and worker exchange, on either lane (each frame length-prefixed: lane_socket.py):

    worker -> driver   Hello       once per lane, on connecting: who this is
    driver -> worker   Call        run `command` with `params`, encoded on their own: the worker
                                   decodes them with the type its handler takes (params.py)
    worker -> driver   Result      the call's return value, encoded on its own (`result`): the
                                   driver decodes it with the type it expects (results.py)
    worker -> driver   Failure     the call raised: exception type and message
    worker -> driver   Heartbeat   control lane, every heartbeat_s: busy with what, progress count
"""

from __future__ import annotations

import msgspec

from timeshare.protocols import wire


class _Frame(msgspec.Struct, frozen=True, tag_field="kind"):
    """Base of every command-lane frame."""


class Hello(_Frame, frozen=True, tag="hello"):
    role: str
    rank: int
    pid: int
    lane: str


class Call(_Frame, frozen=True, tag="call"):
    id: int
    command: str
    params: msgspec.Raw  # msgpack of the command's params (params.py)


class Result(_Frame, frozen=True, tag="result"):
    id: int
    value: msgspec.Raw  # msgpack of the return value, decoded by the caller with its type


class Failure(_Frame, frozen=True, tag="failure"):
    id: int
    type: str
    message: str


class Heartbeat(_Frame, frozen=True, tag="heartbeat"):
    busy: int | None  # id of the call on the work lane, if any
    command: str | None
    progress: int  # grows while the worker makes progress
    waiting: bool = False  # blocked on its peer (weight channel), under that channel's deadlines
    # Seconds the busy call has gone without progress, by the worker's own clock (0 while it
    # waits on its peer): the driver's stall rule reads this, not its own clock.
    idle_s: float = 0.0
    # Nanoseconds the threads of this worker's process tree (its engine's processes included)
    # have waited for a CPU, and run on one, so far (summed; 0 where the kernel keeps no
    # schedstat): a driver that hears nothing for a while reads the tree again to tell a worker
    # starved of CPU from one stopped or stuck (cpu_wait.py; the rule is state/stall.py's).
    cpu_wait_ns: int = 0
    cpu_ran_ns: int = 0


ToWorker = Call
FromWorker = Hello | Result | Failure | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(frame: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(frame)


def result(call_id: int, value: object) -> Result:
    """The frame carrying `value` (a msgspec Struct, or anything msgpack can encode)."""
    return Result(call_id, msgspec.Raw(_encoder.encode(value)))


def decode_to_worker(data: bytes) -> ToWorker:
    return wire.decode(_to_worker, data, "command")


def decode_from_worker(data: bytes) -> FromWorker:
    frame: FromWorker = wire.decode(_from_worker, data, "worker")
    return frame


def failure(call_id: int, exc: BaseException) -> Failure:
    """The frame that reports `exc` raised by call `call_id`, its text cut to fit."""
    return Failure(call_id, *wire.error_text(exc))
