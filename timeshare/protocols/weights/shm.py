"""Shared-memory staging: one /dev/shm segment per buffer, mapped by sender and receiver.

A segment's name says whose it is (segments.py). It has a name only between `create` and
`unlink_names` (the handshake); after that it disappears with its last mapping. The receiver maps
segments without registering them anywhere (Python 3.11's resource tracker would unlink the
owner's segment when the receiver exits).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait

import structlog
import torch

from timeshare.errors import TransferError
from timeshare.protocols.weights.descriptions import ShmSegments
from timeshare.protocols.weights.segments import SEGMENT_PREFIX, segment_names
from timeshare.protocols.weights.staging import Staging
from timeshare.runtime import SHM_ROOT

log = structlog.get_logger(__name__)

# madvise(2) advice that populates a range in one call (Linux 5.14); not in Python 3.11's mmap.
MADV_POPULATE_WRITE = 23
_LIBC = ctypes.CDLL(None, use_errno=True)
# The least a buffer's fault-in is waited for, however small (a loaded machine).
FAULT_IN_MIN_S = 60.0


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
        self._faulting: ThreadPoolExecutor | None = None
        self._faulted: list[Future[None]] = []  # each buffer's fault-in, once started

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
        return cls(maps, names, buffer_bytes)

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
        # Not faulted in here: the sender faults the pages in once the handshake is over, and
        # this side maps them as it first reads each (minor faults, cheap next to the sender's).
        return cls(maps, list(description.names), description.buffer_bytes)

    def start_fault_in(self) -> None:
        """Start faulting every page in for writing, in the background; each buffer is waited
        for only where it is first used (`ready`).

        Fresh shared pages cost 5-10x a warm copy to touch (1.3 GB/s against 10 GB/s here), so
        this is most of a cold first SYNC. The kernel populates each buffer in one call
        (`populate`: about 20% faster than touching it from torch), every buffer on a thread of
        its own, with the GIL released. Started after the handshake: a peer's mmap of a segment
        waits while its pages are being populated (0.8 s for 1 GiB here).
        """
        if self._faulted:
            return
        workers = min(len(self.buffers), os.cpu_count() or 1)
        self._faulting = ThreadPoolExecutor(workers, thread_name_prefix="timeshare-fault-in")
        # One thread a buffer: populating one segment from two threads scales badly here (they
        # contend on its page cache), two segments at once nearly twice as well.
        self._faulted = [self._faulting.submit(populate, buffer) for buffer in self.buffers]
        self._faulting.shutdown(wait=False)  # its threads end with their work, not the session

    def is_ready(self, index: int) -> bool:
        return not self._faulted or self._faulted[index].done()

    def ready(self, index: int) -> None:
        if not self._faulted:
            return
        deadline_s = self._fault_in_deadline_s()
        try:
            self._faulted[index].result(timeout=deadline_s)
        except TimeoutError as exc:
            raise TransferError(
                f"staging buffer {index} ({self.buffer_bytes} bytes) not faulted in within "
                f"{deadline_s:.0f} s"
            ) from exc

    def _fault_in_deadline_s(self) -> float:
        """Bounded: the kernel faults in a GiB in about a second here; allow 20x that."""
        return FAULT_IN_MIN_S + 20 * self.buffer_bytes / 2**30

    def describe(self) -> ShmSegments:
        return ShmSegments(names=list(self._names), buffer_bytes=self.buffer_bytes)

    def unlink_names(self) -> None:
        """Remove the segments' names: the memory lives on until the last mapping goes."""
        for name in self._names:
            _unlink_quietly(name)

    def view(self, index: int) -> tuple[torch.Tensor, torch.UntypedStorage]:
        """A fresh tensor over buffer `index` (faulted in), and its storage.

        The storage's use count tells afterwards whether anything kept a view of it
        (`views_alive`).
        """
        self.ready(index)
        base = torch.frombuffer(memoryview(self._maps[index]), dtype=torch.uint8)
        return base, base.untyped_storage()

    def close(self) -> None:
        """Unmap every buffer that nothing views any more; forget the rest safely."""
        # Never unmap under a running madvise: a fault-in still running past its deadline leaves
        # the buffers mapped (they go with the process).
        _, running = wait(self._faulted, timeout=self._fault_in_deadline_s())
        if running:
            log.warning("staging.close.still_faulting", buffers=len(running))
            return
        if self._faulting is not None:
            self._faulting.shutdown(wait=True)  # their work is done: the threads are ending
            self._faulting = None
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


# Pages faulted in per madvise call. The kernel holds the process's mmap lock for the whole
# call, and every mmap/munmap of the process (the allocator's arenas, the event loop's own)
# waits for it: a 64 MiB call under load held the sender's event loop for up to 58 ms.
POPULATE_CHUNK = 4 * 2**20


def populate(buffer: torch.Tensor) -> None:
    """Have the kernel fault in every page of `buffer` (a mapping of its own) for writing, a
    chunk at a time; where it cannot (a kernel before 5.14), touch every page from torch. Both
    release the GIL (ctypes calls and torch's kernels do)."""
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for address in range(start, end, POPULATE_CHUNK):
        length = min(POPULATE_CHUNK, end - address)
        if _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE):
            buffer[address - start :].zero_()
            return


def _create_segment(name: str, nbytes: int) -> mmap.mmap:
    path = SHM_ROOT / name
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
    path = SHM_ROOT / name
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
        (SHM_ROOT / name).unlink()
