"""The CPU reference trainer's heap: what it frees goes back to the OS each step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest import mock

from tests.engines.torch_ref.test_engines import SPEC
from timeshare.engines.torch_ref.trainer import TorchRefTrainer

ROOT = Path(__file__).resolve().parents[2]

# Allocate and free an 8 MiB tensor (glibc maps it; that free raises its adaptive mmap
# threshold), allocate another (now on the heap), pin the heap's top above it, free it: how
# much of the process's RSS went.
FREED_MIB = """
import sys, torch
from timeshare.engines.host_memory import return_free_heap
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
x = torch.empty(8 << 20, dtype=torch.uint8); x.fill_(1); del x
y = torch.empty(8 << 20, dtype=torch.uint8); y.fill_(1)
pin = torch.ones(1024, dtype=torch.uint8)
before = rss(); del y
if sys.argv[1] == "returned":
    assert return_free_heap()
print((before - rss()) / 2**20)
"""


def freed_mib(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", FREED_MIB, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(out.stdout.strip())


def test_a_hole_freed_in_the_heap_leaves_the_process_once_returned() -> None:
    assert freed_mib("kept") < 1.0  # glibc keeps a free hole below the heap's top resident
    assert freed_mib("returned") > 7.5


def test_the_reference_trainer_returns_its_heap_once_its_parameters_are_offloaded() -> None:
    calls: list[str] = []
    trainer = TorchRefTrainer(0, 1, SPEC)
    with mock.patch(
        "timeshare.engines.torch_ref.trainer.return_free_heap", lambda: calls.append("trim")
    ):
        trainer.offload()
        assert calls == []
        trainer.offload_params()
        assert calls == ["trim"]
