"""Many weight transfers in a process of their own, printing what it held before and after.

    python -m tests.protocols.weights.churn one-session|fresh-pairs RUNTIME_DIR

test_resources.py runs this in a fresh interpreter, so that RSS measures the weight channel and
nothing else: a pytest worker that ran an engine in-process before (vLLM's or FSDP's threads)
keeps allocator arenas whose pages come and go with whatever runs next, which once grew RSS by
44 MB over 50 transfers that had leaked nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from pathlib import Path

import anyio
import msgspec
import psutil
import structlog
import torch

from tests.conftest import socket_files, staging_segments
from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender

# linger_s: a fresh pair's sender says goodbye to a receiver that has often closed already, and
# waits linger_s for an answer that will not come (1 s by default: 55 s over these pairs).
CFG = TransferConfig(bucket_mb=1, pipeline_depth=2, ack_timeout_s=20.0, linger_s=0.2)
WEIGHTS = {f"w{i}": torch.randn(300_000) for i in range(4)}  # 4.6 MiB, split over 1 MiB buckets
LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


class Usage(msgspec.Struct, frozen=True):
    fds: int
    segments: int
    sockets: int
    threads: int
    rss: int
    shm_maps: int  # mappings of /dev/shm: staging this process still maps

    @classmethod
    def now(cls, runtime_dir: Path) -> Usage:
        # Memory freed but kept by glibc's allocator is not a leak: return it to the system
        # first, so that what RSS still holds is held by live objects.
        LIBC.malloc_trim(0)
        with open("/proc/self/maps") as maps:
            shm_maps = sum("/dev/shm/" in line for line in maps)
        return cls(
            fds=len(os.listdir("/proc/self/fd")),
            segments=len(staging_segments(runtime_dir)),
            sockets=len(socket_files(runtime_dir)),
            threads=threading.active_count(),
            rss=psutil.Process().memory_info().rss,
            shm_maps=shm_maps,
        )


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


async def one_session(runtime_dir: Path) -> dict[str, object]:
    """210 transfers on one open session (the first 10 warm up)."""
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
    return {"versions": versions, "before": before, "during": during}


async def fresh_pairs(runtime_dir: Path) -> dict[str, object]:
    """55 transfers, each by a sender and receiver of its own (the first 5 warm up)."""
    url = f"ipc://{runtime_dir}/w.sock"
    versions: list[int] = []
    for version in range(5):
        await transfer(url, range(version, version + 1), versions)
    before = Usage.now(runtime_dir)
    for version in range(5, 55):
        await transfer(url, range(version, version + 1), versions)
    return {"versions": versions, "before": before}


SCENARIOS = {"one-session": one_session, "fresh-pairs": fresh_pairs}


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    scenario, runtime_dir = SCENARIOS[sys.argv[1]], Path(sys.argv[2])
    report = anyio.run(scenario, runtime_dir)
    report["after"] = Usage.now(runtime_dir)
    sys.stdout.write(msgspec.json.encode(report).decode() + "\n")


if __name__ == "__main__":
    main()
