"""The CPU reference trainer's heap: model-sized blocks go back to the OS when freed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Allocate and free an 8 MiB tensor (glibc maps it; left adaptive, that free raises its mmap
# threshold), allocate another, pin the heap's top above it, free it: how much RSS went.
FREED_MIB = """
import sys, torch
from timeshare.engines.host_memory import map_large_blocks
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "mapped":
    assert map_large_blocks()
if sys.argv[1] == "trainer":
    from tests.engines.torch_ref.test_engines import SPEC
    from timeshare.engines.torch_ref.trainer import TorchRefTrainer
    TorchRefTrainer(0, 1, SPEC)
x = torch.empty(8 << 20, dtype=torch.uint8); x.fill_(1); del x
y = torch.empty(8 << 20, dtype=torch.uint8); y.fill_(1)
pin = torch.ones(1024, dtype=torch.uint8)
before = rss(); del y
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


def test_a_freed_model_sized_block_leaves_the_process_once_large_blocks_are_mapped() -> None:
    # glibc's adaptive threshold keeps the second block on the heap: nothing goes back...
    assert freed_mib("adaptive") < 1.0
    # ...the fixed one maps it, and its free returns all of it.
    assert freed_mib("mapped") > 7.5


def test_the_reference_trainer_maps_large_blocks_in_its_process() -> None:
    assert freed_mib("trainer") > 7.5
