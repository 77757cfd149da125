"""Where a job stands: each rank's phase, the step, the pending requests, and why it stopped.

The phase machine (machine.py) moves a `JobState` to the next; this holds the state itself and
the constants of the cycle it moves through.
"""

from __future__ import annotations

from dataclasses import dataclass

from timeshare.state.events import Blame, Commanded, Lifecycle, Phase, Request

NEXT_PHASE: dict[Phase, Phase] = {
    Phase.TRAIN: Phase.OFFLOAD,
    Phase.OFFLOAD: Phase.SYNC,
    Phase.SYNC: Phase.BARRIER,
    Phase.BARRIER: Phase.RESUME,
    Phase.RESUME: Phase.ROLLOUT,
    Phase.ROLLOUT: Phase.TRAIN,
}
FIRST_PHASE = Phase.SYNC  # where bootstrap enters the cycle
CYCLE_START = Phase.TRAIN  # entering it starts a new step; the boundary before it is the cycle's
# Phases a rank enters only once every rank has finished the one before: the memory handoffs.
MEMORY_FENCES: frozenset[Phase] = frozenset({Phase.SYNC, Phase.RESUME, Phase.TRAIN})
LIVE = (Lifecycle.STARTING, Lifecycle.RUNNING, Lifecycle.PAUSED, Lifecycle.DRAINING)


@dataclass(frozen=True)
class RankProgress:
    """Where one rank stands: in `phase` (working), or done with it and waiting (at a fence,
    or for the job to start or drain). `meeting`: its BARRIER checked, it waits for the other
    ranks at the node's meeting."""

    phase: Phase
    done: bool = False
    meeting: bool = False


@dataclass(frozen=True)
class JobState:
    lifecycle: Lifecycle
    ranks: tuple[RankProgress, ...]
    step: int = 0  # the step the job is in (incremented on entering TRAIN)
    max_steps: int | None = None
    requests: frozenset[Request] = frozenset()
    fences: frozenset[Phase] = MEMORY_FENCES
    checking_release: bool = False  # at the pause boundary, waiting for `PauseChecked`
    nodes: int = 1  # nodes whose ranks cross every fence together (this state holds one's)
    first_rank: int = 0  # the job's rank number of `ranks[0]` (names ranks in reasons)
    crossing: Phase | None = None  # every local rank at this fence: waiting for the other nodes
    held: tuple[Commanded, ...] = ()  # several nodes: commands waiting for the next crossing
    reason: str | None = None  # why the job is draining, stopped or failed
    blame: Blame | None = None  # the worker and phase a failure is pinned on

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(r.phase for r in self.ranks)

    @property
    def idle(self) -> bool:
        """No work in flight: no rank in a phase or at the node's meeting, no release check,
        no wait for the other nodes."""
        return (
            all(r.done for r in self.ranks) and not self.checking_release and self.crossing is None
        )


def initial_state(
    ranks: int,
    *,
    max_steps: int | None = None,
    fences: frozenset[Phase] = MEMORY_FENCES,
    nodes: int = 1,
    first_rank: int = 0,
) -> JobState:
    """A job that is starting: workers not yet up, nothing loaded, nothing running.

    With several `nodes`, the state is one node's: its `ranks`, the first numbered `first_rank`.
    """
    if ranks < 1:
        raise ValueError(f"a job needs at least one rank, got {ranks}")
    if nodes < 1 or first_rank < 0:
        raise ValueError(f"nodes ({nodes}) must be at least 1, first_rank ({first_rank}) >= 0")
    if not fences <= MEMORY_FENCES:
        raise ValueError(f"fences must be a subset of {sorted(p.value for p in MEMORY_FENCES)}")
    progress = tuple(RankProgress(FIRST_PHASE, done=True) for _ in range(ranks))
    return JobState(
        Lifecycle.STARTING,
        progress,
        max_steps=max_steps,
        fences=fences,
        nodes=nodes,
        first_rank=first_rank,
    )
