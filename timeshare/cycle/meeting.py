"""BARRIER's meeting of a node's ranks, kept in the driver that runs them all.

Every rank of a node is driven by this one process, so who has come is known here: the meeting
needs no store round trip (it took a BARRIER 1.2 ms of store calls and thread hops per rank at
two ranks). What the job store's barrier gave is kept: a deadline (`[deadlines].barrier_s`)
whose failure names the ranks that did not come. Across nodes, the nodes cross in the job store
before RESUME (nodes.py), as at every fence.
"""

from __future__ import annotations

import anyio

from timeshare.errors import CollectiveTimeout

NAME = "barrier"


class NodeMeeting:
    """Ranks 0..ranks-1 of node `node` (numbered on it; `first_rank` is the global number of its
    rank 0) meet, one generation after another: a generation is over when every rank came."""

    def __init__(self, ranks: int, *, first_rank: int = 0, node: int = 0) -> None:
        self.ranks = ranks
        self.first_rank = first_rank
        self.node = node
        self.generation = 1
        self._came: set[int] = set()
        self._all_came = anyio.Event()

    async def meet(self, rank: int, *, timeout_s: float) -> None:
        """Rank `rank` comes, and waits until every rank has come; `CollectiveTimeout` naming
        those that did not (global numbers) and their node after `timeout_s`."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not in 0..{self.ranks - 1}")
        generation, came, all_came = self.generation, self._came, self._all_came
        came.add(rank)
        if len(came) == self.ranks:
            self._next_generation()
            all_came.set()
        with anyio.move_on_after(timeout_s):
            await all_came.wait()
            return
        missing = [self.first_rank + r for r in range(self.ranks) if r not in came]
        raise CollectiveTimeout(
            f"{NAME} (generation {generation}) timed out after {timeout_s:g} s on rank "
            f"{self.first_rank + rank}: ranks {missing} did not arrive (node {self.node})",
            name=NAME,
            generation=generation,
            missing=missing,
        )

    def call_off(self) -> None:
        """Nobody waits any more (a drain began): the next meeting starts afresh."""
        self._next_generation()

    def _next_generation(self) -> None:
        self.generation += 1
        self._came = set()
        self._all_came = anyio.Event()
