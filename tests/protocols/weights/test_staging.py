"""Shared-memory staging is resident before a buffer's first use: the sender faults every page
of every buffer in, in the background, once the handshake is over (`start_fault_in`), and
`ready` waits for a buffer; nothing is left in /dev/shm once both ends are closed."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

from tests.conftest import staging_segments
from timeshare.protocols.weights.segments import staging_tag
from timeshare.protocols.weights.shm import SharedMemoryStaging, populate
from timeshare.runtime import SHM_ROOT

BUFFER_BYTES = 8 * 2**20


def resident_bytes(buffer: torch.Tensor) -> int:
    """Rss of the mapping that holds `buffer` (/proc/self/smaps), in bytes."""
    start = buffer.data_ptr()
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= start < high
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError("no mapping holds the buffer")


def test_buffers_are_resident_once_ready(runtime_dir: Path) -> None:
    tag = staging_tag(runtime_dir)
    staging = SharedMemoryStaging.create(count=3, buffer_bytes=BUFFER_BYTES, tag=tag, session=1)
    try:
        assert [resident_bytes(b) for b in staging.buffers] == [0] * 3  # mapped, not touched
        peer = SharedMemoryStaging.attach(staging.describe())  # (a peer maps it untouched)
        try:
            staging.start_fault_in()
            for index in range(3):
                staging.ready(index)
                assert staging.is_ready(index)
            assert [resident_bytes(b) for b in staging.buffers] == [BUFFER_BYTES] * 3
            staging.buffers[2][-1] = 7
            base, _ = peer.view(2)
            assert int(base[-1]) == 7 and int(peer.view(0)[0].max()) == 0
            del base
        finally:
            peer.close()
    finally:
        staging.unlink_names()
        staging.close()
    assert staging_segments(runtime_dir) == set()
    assert not [t for t in threading.enumerate() if t.name.startswith("timeshare-fault-in")]


def test_populate_faults_in_a_fresh_mapping() -> None:
    path = SHM_ROOT / f"ts-test-populate-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, BUFFER_BYTES)
        mapped = mmap.mmap(fd, BUFFER_BYTES, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        path.unlink()
    buffer = torch.frombuffer(mapped, dtype=torch.uint8)
    assert resident_bytes(buffer) == 0
    populate(buffer)
    assert resident_bytes(buffer) == BUFFER_BYTES
    del buffer
    mapped.close()
