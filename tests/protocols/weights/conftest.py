"""Fixtures of the weight-channel tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.protocols.weights.peers import endpoint


@pytest.fixture
def rogue_sender(runtime_dir: Path) -> Iterator[zmq.Socket[bytes]]:
    """A raw REQ socket bound where the tests' WeightSender would be, to send what no sender
    would."""
    context = zmq.Context()
    rogue = context.socket(zmq.REQ)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(endpoint(runtime_dir))
    yield rogue
    rogue.close()
    context.term()
    os.unlink(runtime_dir / "w-rank0.sock")
