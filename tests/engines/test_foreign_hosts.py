"""The /dev/shm check the tests of foreign engines share: what stays there mapped by no live
process is a leak; what a live process maps (another test's, running beside) is not."""

from __future__ import annotations

import mmap
import os
import uuid

from tests.engines.foreign_hosts import left_in_shm, shm_names
from timeshare.protocols.weights.segments import SHM_DIR as SHM


def test_a_file_nobody_maps_is_left_and_a_mapped_one_is_not() -> None:
    before = shm_names()
    mapped, leaked = SHM / f"tsprobe-mapped-{uuid.uuid4().hex}", SHM / f"tsprobe-{uuid.uuid4().hex}"
    fd = os.open(mapped, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        with mmap.mmap(fd, mmap.PAGESIZE):
            leaked.touch()
            try:
                left = left_in_shm(before, settle_s=0.5)  # (other tests' files may come and go)
                assert leaked.name in left and mapped.name not in left, left
            finally:
                leaked.unlink()
            left = left_in_shm(before, settle_s=0.5)
            assert leaked.name not in left and mapped.name not in left, left
    finally:
        os.close(fd)
        mapped.unlink()
