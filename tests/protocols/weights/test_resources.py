"""Many transfers leave nothing behind: fds, staging, socket files, threads and RSS stay flat."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import anyio
import psutil
import pytest
import torch

from tests.conftest import socket_files, staging_segments
from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender

CFG = TransferConfig(bucket_mb=1, pipeline_depth=2, ack_timeout_s=20.0)
WEIGHTS = {f"w{i}": torch.randn(300_000) for i in range(4)}  # 4.6 MiB, split over 1 MiB buckets
RSS_TOLERANCE = 24 * 2**20
LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


@dataclass(frozen=True)
class Usage:
    fds: int
    segments: int
    sockets: int
    threads: int
    rss: int

    @classmethod
    def now(cls, runtime_dir: Path) -> Usage:
        # Memory freed but kept by glibc's allocator is not a leak: return it to the system
        # first, so that what RSS still holds is held by live objects. (A pytest worker that
        # ran an engine in-process before, vLLM's or FSDP's threads, keeps many arenas whose
        # free pages would otherwise count.)
        LIBC.malloc_trim(0)
        return cls(
            fds=len(os.listdir("/proc/self/fd")),
            segments=len(staging_segments(runtime_dir)),
            sockets=len(socket_files(runtime_dir)),
            threads=threading.active_count(),
            rss=psutil.Process().memory_info().rss,
        )


def assert_flat(before: Usage, after: Usage) -> None:
    assert after.fds <= before.fds + 2, (before, after)
    assert after.segments <= before.segments, (before, after)
    assert after.sockets == 0, (before, after)
    assert after.threads <= before.threads + 2, (before, after)
    assert after.rss - before.rss < RSS_TOLERANCE, (before, after)


def receiving(url: str, transfers: int, versions: list[int]) -> threading.Thread:
    def run() -> None:
        with WeightReceiver(url, CFG) as receiver:
            for _ in range(transfers):
                versions.append(receiver.receive(lambda items: None).version)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


async def transfer(url: str, versions: range, receiver_versions: list[int]) -> None:
    thread = receiving(url, len(versions), receiver_versions)
    with WeightSender(url, CFG) as sender:
        for version in versions:
            await sender.send(WEIGHTS, version=version)
    await anyio.to_thread.run_sync(thread.join, 30)
    assert not thread.is_alive()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_200_transfers_on_one_session(runtime_dir: Path) -> None:
    url = f"ipc://{runtime_dir}/w.sock"
    versions: list[int] = []
    thread = receiving(url, 210, versions)
    with WeightSender(url, CFG) as sender:
        for version in range(10):
            await sender.send(WEIGHTS, version=version)
        before = Usage.now(runtime_dir)
        for version in range(10, 210):
            await sender.send(WEIGHTS, version=version)
        during = Usage.now(runtime_dir)
    await anyio.to_thread.run_sync(thread.join, 30)
    assert versions == list(range(210))
    # The open session holds its socket file; everything else must not have grown.
    assert during.fds <= before.fds + 2 and during.segments == before.segments, (before, during)
    assert during.rss - before.rss < RSS_TOLERANCE, (before, during)
    assert_flat(before, Usage.now(runtime_dir))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_50_transfers_with_a_fresh_pair_each(runtime_dir: Path) -> None:
    url = f"ipc://{runtime_dir}/w.sock"
    versions: list[int] = []
    for version in range(5):
        await transfer(url, range(version, version + 1), versions)
    before = Usage.now(runtime_dir)
    for version in range(5, 55):
        await transfer(url, range(version, version + 1), versions)
    assert versions == list(range(55))
    assert_flat(before, Usage.now(runtime_dir))
