"""vLLM's own processes under faults, for real: a vLLM worker SIGKILLed in the middle of a
transfer, and the process that hosts vLLM SIGKILLed. Each test starts its own engine (host.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import psutil
import pytest

from tests.engines.foreign_hosts import Host, assert_nothing_left
from tests.engines.vllm.conftest import MODEL, TRANSFER
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
    started = Host("tests.engines.vllm.host", runtime_dir)
    try:
        yield started
    finally:
        started.stop()


def vllm_processes(event: dict[str, Any]) -> list[int]:
    return [int(pid) for pid in event["vllm"]]


def vllm_worker(processes: list[int]) -> int:
    for pid in processes:
        if psutil.Process(pid).name().startswith("VLLM::Worker"):
            return pid
    raise AssertionError(f"no VLLM::Worker among {processes}")


def test_a_vllm_worker_killed_mid_transfer_is_an_ack_timeout_on_the_trainer(
    runtime_dir: Path, host: Host
) -> None:
    ready = host.next_event()
    processes = vllm_processes(ready)
    worker = vllm_worker(processes)
    weights = [(n, p.detach()) for n, p in init_model(MODEL, seed=0).named_parameters()]
    with ThreadPoolExecutor(1) as trainer:
        sender = trainer.submit(WeightSender, host.endpoint, SENDER).result()
        sending = trainer.submit(anyio.run, partial(sender.send, weights, version=1))
        # Mid-transfer: the worker has mapped the trainer's staging (the handshake is done and
        # buckets are on their way).
        deadline = time.monotonic() + 60
        while not mapped_segments(worker, SEGMENT_PREFIX):
            assert time.monotonic() < deadline, "the vLLM worker never mapped the staging"
            time.sleep(0.005)
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(AckTimeout) as timed_out:
            sending.result(timeout=120)
        waited = time.monotonic() - started
        trainer.submit(sender.close).result(timeout=30)
    # The worker had mapped the staging: the kill lands before its ACK of the mapping went out
    # (a loaded machine) or during the buckets.
    assert timed_out.value.phase in ("mapped", "bucket", "released", "finalized")
    assert waited < max(SENDER.ack_timeout_s, SENDER.handshake_timeout_s) + 10
    event = host.next_event()
    assert event["event"] == "error", event  # vLLM's engine died with its worker: said so
    assert host.proc.wait(timeout=60) == 1
    assert wait_gone(processes, 10) == []
    assert_nothing_left(runtime_dir)


def test_vllm_processes_die_with_the_process_that_hosts_them(runtime_dir: Path, host: Host) -> None:
    processes = vllm_processes(host.next_event())
    assert len(processes) >= 2  # VLLM::EngineCore and its VLLM::Worker
    records = list(runtime_dir.glob("*.segments.json"))
    assert records and json.loads(records[0].read_text())["segments"]  # their memory is on record
    host.proc.send_signal(signal.SIGKILL)
    host.proc.wait(timeout=10)
    assert wait_gone(processes, 5) == []  # the parent-death signal, not a sweep
    assert_nothing_left(runtime_dir)
