"""Fixtures of the weight-channel tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq


@pytest.fixture
def rogue_sender(runtime_dir: Path) -> Iterator[zmq.Socket[bytes]]:
    """A raw REQ socket bound at `<runtime_dir>/w-rank0.sock`, where the tests' WeightSender
    would be, to send what no sender would."""
    context = zmq.Context()
    rogue = context.socket(zmq.REQ)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(f"ipc://{runtime_dir}/w-rank0.sock")
    yield rogue
    rogue.close()
    context.term()
    os.unlink(runtime_dir / "w-rank0.sock")
