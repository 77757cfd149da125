"""A command lane's socket: a UNIX stream socket carrying length-prefixed frames.

Each frame is a 4-byte little-endian length, then that many bytes (one msgpack frame of
frames.py). `FrameReader` cuts frames out of whatever the socket delivered, knowing nothing of
sockets (both ends use it); `WorkerSocket` is the worker's blocking end, `DriverConnection` one
connection at the driver's event loop.

Why not ZMQ, as the weight channel uses: a ZMQ message crosses four threads (the sender's, its
I/O thread, the receiver's I/O thread, the receiver's), a UNIX socket two. A call and its answer
took 0.24 ms at the median over ZMQ and 0.08 ms over the socket here, 0.37 against 0.09 ms from
the driver's event loop: the lanes carry a few small frames per phase, so that difference was
most of a phase's orchestration (benchmarks/orchestration.py).

The driver's end is an asyncio protocol, not an anyio stream: frames are handed on as they arrive
and written without a trip through the event loop, which halves the driver's CPU per call
(the lanes' calls are most of what the driver does in a phase). The driver runs on asyncio, as
it did under zmq.asyncio.
"""

from __future__ import annotations

import asyncio
import errno
import select
import socket
import struct
import time
from collections.abc import Callable

from timeshare.errors import ProtocolError

HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30  # a frame past this is a broken peer, not a message: the connection ends
RECEIVE_CHUNK = 1 << 16
CONNECT_RETRY_S = 0.02


def pack(frame: bytes) -> bytes:
    """`frame` as it goes on the socket."""
    if len(frame) > MAX_FRAME:
        raise ProtocolError(f"a frame of {len(frame)} bytes is over the lane's {MAX_FRAME}")
    return HEADER.pack(len(frame)) + frame


class FrameReader:
    """Frames out of a byte stream: `feed` what arrived, take the frames it completed."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames `data` completed, in order; `ProtocolError` for a length past MAX_FRAME
        (nothing after it can be framed)."""
        self._buffer += data
        frames: list[bytes] = []
        start = 0
        while len(self._buffer) - start >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer, start)
            if length > MAX_FRAME:
                raise ProtocolError(f"a frame of {length} bytes is over the lane's {MAX_FRAME}")
            end = start + HEADER.size + length
            if len(self._buffer) < end:
                break
            with memoryview(self._buffer) as view:  # one copy, not two
                frames.append(bytes(view[start + HEADER.size : end]))
            start = end
        del self._buffer[:start]
        return frames


class WorkerSocket:
    """The worker's end of one lane: blocking, used by one thread."""

    def __init__(self, path: str, *, connect_timeout_s: float) -> None:
        self._socket = _connect(path, connect_timeout_s)
        self._reader = FrameReader()
        self._ready: list[bytes] = []
        self._poll = select.poll()
        self._poll.register(self._socket, select.POLLIN)

    def fileno(self) -> int:
        return self._socket.fileno()

    def send(self, frame: bytes) -> None:
        """Send a whole frame; `ConnectionError` once the driver is gone."""
        self._socket.sendall(pack(frame))

    def receive(self, timeout_s: float) -> bytes | None:
        """The next frame, or None if none came within `timeout_s`; `ConnectionError` once the
        driver closed its end, `ProtocolError` for a stream that cannot be framed."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(max(1, round(left * 1000))):
                return None
            data = self._socket.recv(RECEIVE_CHUNK)
            if not data:
                raise ConnectionResetError("the driver closed the lane")
            self._ready.extend(self._reader.feed(data))
        return self._ready.pop(0)

    def close(self) -> None:
        self._socket.close()


def _connect(path: str, timeout_s: float) -> socket.socket:
    """Connect to the driver's socket at `path`, retrying while it is not there yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError as exc:
            sock.close()
            retry = exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN)
            if not retry or time.monotonic() > deadline:
                raise ConnectionError(f"cannot connect to the lane at {path}: {exc}") from exc
        time.sleep(CONNECT_RETRY_S)


class DriverConnection(asyncio.Protocol):
    """One worker connection at the driver: each frame goes to `on_frame(self, frame)` as it
    arrives, a stream that cannot be framed to `on_broken(self, error)` (then it is closed), and
    the end of the connection to `on_lost(self)`. Writes never wait; `drained` waits while the
    peer is not reading."""

    def __init__(
        self,
        on_frame: Callable[[DriverConnection, bytes], None],
        on_broken: Callable[[DriverConnection, ProtocolError], None],
        on_lost: Callable[[DriverConnection], None],
    ) -> None:
        self._on_frame = on_frame
        self._on_broken = on_broken
        self._on_lost = on_lost
        self._reader = FrameReader()
        self._transport: asyncio.WriteTransport | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except ProtocolError as exc:
            self._on_broken(self, exc)
            self.close()
            return
        for frame in frames:
            self._on_frame(self, frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._writable.set()  # a writer waiting to drain learns the end at once
        self._on_lost(self)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def send(self, frame: bytes) -> None:
        """Write the frame (the event loop keeps what the socket did not take at once);
        `ConnectionResetError` if the connection is gone."""
        if self.closed or self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self._transport.write(pack(frame))

    @property
    def backed_up(self) -> bool:
        """The peer has not read what was written, past the transport's high-water mark."""
        return not self._writable.is_set()

    async def drained(self) -> None:
        """Until what was written is below the high-water mark again (or the peer is gone)."""
        await self._writable.wait()
        if self.closed:
            raise ConnectionResetError("the connection closed with frames unsent")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
