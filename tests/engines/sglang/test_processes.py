"""SGLang's own processes under faults, for real: its scheduler SIGKILLed in the middle of a
transfer, and the process that hosts SGLang SIGKILLed. Each test starts its own engine (host.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import anyio
import msgspec
import psutil
import pytest

from tests.engines.foreign_hosts import Host, assert_nothing_left, left_in_shm, shm_names
from tests.engines.sglang.conftest import MODEL, TRANSFER
from timeshare.engines.torch_ref.model import init_model
from timeshare.errors import AckTimeout
from timeshare.protocols.weights import WeightSender
from timeshare.protocols.weights.segments import SEGMENT_PREFIX
from timeshare.runtime import mapped_segments, wait_gone

pytestmark = pytest.mark.slow
# The trainer gives up soon, in the handshake as in the buckets.
SENDER = msgspec.structs.replace(TRANSFER, ack_timeout_s=3.0, handshake_timeout_s=3.0)


@pytest.fixture
def host(runtime_dir: Path) -> Iterator[Host]:
    before = shm_names()
    started = Host("tests.engines.sglang.host", runtime_dir)
    try:
        yield started
    finally:
        started.stop()
    # Nothing of SGLang's stays in /dev/shm: its semaphores (sem.mp-*) go with Python's
    # resource tracker, which outlives SGLang's processes by moments to unlink them.
    assert left_in_shm(before) == []


def scheduler(processes: list[int]) -> int:
    for pid in processes:
        if " ".join(psutil.Process(pid).cmdline()).startswith("sglang::scheduler"):
            return pid
    raise AssertionError(f"no sglang::scheduler among {processes}")


def test_a_scheduler_killed_mid_transfer_is_an_ack_timeout_and_the_engine_says_it_broke(
    runtime_dir: Path, host: Host
) -> None:
    ready = host.next_event()
    tree = [int(pid) for pid in ready["tree"]]
    receiving = scheduler([int(pid) for pid in ready["sglang"]])
    weights = [(n, p.detach()) for n, p in init_model(MODEL, seed=0).named_parameters()]
    with ThreadPoolExecutor(1) as trainer:
        sender = trainer.submit(WeightSender, host.endpoint, SENDER).result()
        sending = trainer.submit(anyio.run, partial(sender.send, weights, version=1))
        # Mid-transfer: SGLang's scheduler, where timeshare's loader runs, mapped the staging.
        deadline = time.monotonic() + 60
        while not mapped_segments(receiving, SEGMENT_PREFIX):
            assert time.monotonic() < deadline, "SGLang's scheduler never mapped the staging"
            time.sleep(0.005)
        os.kill(receiving, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(AckTimeout) as timed_out:
            sending.result(timeout=120)
        waited = time.monotonic() - started
        trainer.submit(sender.close).result(timeout=30)
    assert timed_out.value.phase in ("mapped", "bucket", "released", "finalized")
    assert waited < max(SENDER.ack_timeout_s, SENDER.handshake_timeout_s) + 10
    event = host.next_event()
    assert event["event"] == "error", event  # the engine says it cannot go on, and why
    assert event["type"] == "EngineBroken", event
    assert host.proc.wait(timeout=60) == 1
    assert wait_gone(tree, 30) == []
    assert_nothing_left(runtime_dir)


def test_sglang_processes_die_with_the_process_that_hosts_them(
    runtime_dir: Path, host: Host
) -> None:
    ready = host.next_event()
    processes = [int(pid) for pid in ready["sglang"]]
    tree = [int(pid) for pid in ready["tree"]]
    assert len(processes) >= 2  # sglang::scheduler and sglang::detokenizer
    host.proc.send_signal(signal.SIGKILL)
    host.proc.wait(timeout=10)
    assert wait_gone(tree, 10) == []  # the parent-death signal, not a sweep
    assert_nothing_left(runtime_dir)
