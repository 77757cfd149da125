"""TCP ports for what a test starts and others connect to (a job store's leader, a process
group's rendezvous), chosen so that two tests running at once never share one.

Asking the kernel for any free port and closing it races: a test on another pytest worker may
be handed the same port before either binds it (two leaders then share one job store), and any
outgoing connection may take it meanwhile. These come from below the kernel's ephemeral range
(no connection is handed one), from a block of their own for each pytest worker, starting at a
random place in it (another pytest session on the machine picks elsewhere, most likely).
A session without workers takes the block PORT_BLOCK_ENV names (make test runs two such
sessions side by side, each with its own, above the blocks its parallel stage's workers used),
else the first.
SGLang derives ports of its own from its default port 30000 up (blocks 10 and 11 would share
them) and picks its process group's port at random in 22000-29999, as any process may.
"""

from __future__ import annotations

import os
import random
import socket

BASE = 20000  # the ephemeral range starts at 32768 (/proc/sys/net/ipv4/ip_local_port_range)
BLOCK = 1000
BLOCKS = 12  # pytest workers with a block of their own
PORT_BLOCK_ENV = "TESTS_PORT_BLOCK"


def free_port() -> int:
    """A port of this worker's block that nothing listens on now."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    worker = worker or os.environ.get(PORT_BLOCK_ENV, "0")
    block = BASE + (int(worker) % BLOCKS if worker.isdigit() else 0) * BLOCK
    start = random.randrange(BLOCK)
    for offset in range(BLOCK):
        port = block + (start + offset) % BLOCK
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {block}-{block + BLOCK - 1}")
