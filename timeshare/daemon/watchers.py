"""Everyone watching the service (`timesharectl watch`): each gets every entry, or is dropped.

Publishing never waits: a watcher that falls `buffer` entries behind is closed rather than
allowed to hold the cycle back.
"""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

WATCH_BUFFER = 256  # entries a watcher may fall behind by before it is dropped


class Watchers:
    def __init__(self, buffer: int = WATCH_BUFFER) -> None:
        self.buffer = buffer
        self._streams: set[MemoryObjectSendStream[dict[str, object]]] = set()

    def __len__(self) -> int:
        return len(self._streams)

    def subscribe(self, first: dict[str, object]) -> MemoryObjectReceiveStream[dict[str, object]]:
        """A stream of every entry published from now on, starting with `first`."""
        send, receive = anyio.create_memory_object_stream[dict[str, object]](self.buffer)
        send.send_nowait(first)
        self._streams.add(send)
        return receive

    def publish(self, entry: dict[str, object]) -> None:
        for stream in list(self._streams):
            try:
                stream.send_nowait(entry)
            except anyio.WouldBlock:  # too slow: drop it rather than hold the cycle
                stream.close()
                self._streams.discard(stream)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._streams.discard(stream)
