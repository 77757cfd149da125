"""Shared-memory staging: one /dev/shm segment per buffer, mapped by sender and receiver.

A segment's name says whose it is (segments.py). It has a name only between `create` and
`unlink_names` (the handshake); after that it disappears with its last mapping. The receiver maps
segments without registering them anywhere (Python 3.11's resource tracker would unlink the
owner's segment when the receiver exits).
"""

from __future__ import annotations

import contextlib
import mmap
import os

import structlog
import torch

from timeshare.errors import TransferError
from timeshare.protocols.weights.descriptions import ShmSegments
from timeshare.protocols.weights.segments import SEGMENT_PREFIX, SHM_DIR, segment_names
from timeshare.protocols.weights.staging import Staging

log = structlog.get_logger(__name__)


class SharedMemoryStaging(Staging):
    """Equal shared-memory buffers mapped into this process, as uint8 tensors.

    `buffers[i]` is a tensor over the whole of buffer i. The mappings are released by `close()`;
    a mapping that something still views is left to disappear with its last view (never unmapped
    under a live tensor).
    """

    def __init__(self, maps: list[mmap.mmap], names: list[str], buffer_bytes: int) -> None:
        self._maps = maps
        self._names = names
        self.buffer_bytes = buffer_bytes
        self.buffers = [torch.frombuffer(memoryview(m), dtype=torch.uint8) for m in maps]

    @classmethod
    def create(
        cls, *, count: int, buffer_bytes: int, tag: str, session: int
    ) -> SharedMemoryStaging:
        """Create `count` named shared segments of `buffer_bytes` each, owned by this process."""
        names = segment_names(tag=tag, session=session, count=count)
        maps: list[mmap.mmap] = []
        try:
            for name in names:
                maps.append(_create_segment(name, buffer_bytes))
        except BaseException:
            for m in maps:
                m.close()
            for name in names:
                _unlink_quietly(name)
            raise
        staging = cls(maps, names, buffer_bytes)
        staging.fault_in(write=True)
        return staging

    @classmethod
    def attach(cls, description: ShmSegments) -> SharedMemoryStaging:
        """Map the segments a sender described in its handshake."""
        maps: list[mmap.mmap] = []
        try:
            for name in description.names:
                maps.append(_map_segment(name, description.buffer_bytes))
        except BaseException:
            for m in maps:
                m.close()
            raise
        staging = cls(maps, list(description.names), description.buffer_bytes)
        staging.fault_in(write=False)
        return staging

    def fault_in(self, *, write: bool) -> None:
        """Touch every page now, at session set-up, rather than during the first transfer.

        Fresh shared pages cost 5-10x a warm copy to touch. torch releases the GIL while it
        touches them (MAP_POPULATE would hold it for the whole mmap call).
        """
        for buffer in self.buffers:
            if write:
                buffer.zero_()
            else:
                buffer.max()

    def describe(self) -> ShmSegments:
        return ShmSegments(names=list(self._names), buffer_bytes=self.buffer_bytes)

    def unlink_names(self) -> None:
        """Remove the segments' names: the memory lives on until the last mapping goes."""
        for name in self._names:
            _unlink_quietly(name)

    def view(self, index: int) -> tuple[torch.Tensor, torch.UntypedStorage]:
        """A fresh tensor over buffer `index`, and its storage.

        The storage's use count tells afterwards whether anything kept a view of it
        (`views_alive`).
        """
        base = torch.frombuffer(memoryview(self._maps[index]), dtype=torch.uint8)
        return base, base.untyped_storage()

    def close(self) -> None:
        """Unmap every buffer that nothing views any more; forget the rest safely."""
        self.buffers = []
        kept = 0
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                kept += 1  # a live view exports it: unmapped when that view dies
        self._maps = []
        if kept:
            log.warning("staging.close.views_alive", buffers=kept)


def _create_segment(name: str, nbytes: int) -> mmap.mmap:
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise TransferError(f"cannot create staging segment {path}: {exc}") from exc
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except OSError as exc:
        _unlink_quietly(name)
        raise TransferError(f"cannot size staging segment {path} to {nbytes} bytes: {exc}") from exc
    finally:
        os.close(fd)


def _map_segment(name: str, nbytes: int) -> mmap.mmap:
    if "/" in name or not name.startswith(SEGMENT_PREFIX):
        raise TransferError(f"refusing to map staging segment with a foreign name: {name!r}")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise TransferError(f"cannot open staging segment {path}: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise TransferError(f"staging segment {path} holds {size} bytes, offer said {nbytes}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def _unlink_quietly(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / name).unlink()
