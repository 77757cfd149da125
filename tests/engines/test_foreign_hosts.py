"""The /dev/shm check the tests of foreign engines share: what stays there mapped by no live
process is a leak; what a live process maps (another test's, running beside) is not."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import uuid

from tests.engines.foreign_hosts import left_in_shm, shm_names
from timeshare.runtime import SEMAPHORE_PREFIX, mapped_anywhere, mapped_segments
from timeshare.runtime import SHM_ROOT as SHM


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


def test_a_semaphore_its_maker_holds_is_mapped_though_its_maps_name_another_file() -> None:
    """glibc makes a named semaphore under a temporary name and links the real one: its maker's
    maps show only the temporary name, deleted. A live semaphore is no leak."""
    lock = multiprocessing.get_context("spawn").Lock()  # (spawn's: named; fork's are not)
    name = f"sem.{lock._semlock.name.lstrip('/')}"  # type: ignore[attr-defined]
    assert (SHM / name).exists()
    assert name not in mapped_segments(os.getpid(), SEMAPHORE_PREFIX)  # by its name: unseen
    assert mapped_anywhere({name}) == {name}
    assert name not in left_in_shm(shm_names() - {name}, settle_s=0.5)
