"""What can happen to a job: the phase machine's vocabulary (phases, requests) and its events.

Events are facts the driver observed, as frozen dataclasses; the machine (machine.py) decides
what each means. Facts about memory (what a worker still holds) are reported as they are, never
judged here: whether they are a failure is the machine's rule.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias


class Lifecycle(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class Phase(enum.Enum):
    TRAIN = "train"
    OFFLOAD = "offload"
    SYNC = "sync"
    BARRIER = "barrier"
    RESUME = "resume"
    ROLLOUT = "rollout"


class Request(enum.Enum):
    PAUSE = "pause"
    RESUME = "resume"
    DRAIN = "drain"
    STOP = "stop"


@dataclass(frozen=True)
class Blame:
    """Where a failure happened: the worker (role of rank) and the phase (or `pause`, ...)."""

    rank: int
    role: str
    phase: str

    def __str__(self) -> str:
        return f"{self.role} rank {self.rank} in {self.phase}"


@dataclass(frozen=True)
class Held:
    """Device memory one worker said it still holds, in MiB: `mb` it could release (the rules
    check this), `resident_mb` its engine cannot release on this platform (shown, not checked)."""

    role: str
    rank: int
    mb: float
    resident_mb: float = 0.0


@dataclass(frozen=True)
class Bootstrapped:
    """Workers are up and the last durable checkpoint (of `step`) is loaded."""

    step: int


@dataclass(frozen=True)
class RankFinished:
    """`rank` finished `phase` (the driver saw both its workers report success)."""

    rank: int
    phase: Phase


@dataclass(frozen=True)
class BarrierChecked:
    """`rank`'s workers ran BARRIER; its trainer says it still holds `held_mb` of device memory."""

    rank: int
    held_mb: float


@dataclass(frozen=True)
class PauseChecked:
    """Every worker said what device memory it holds, as the job stands at the pause boundary."""

    held: tuple[Held, ...]


@dataclass(frozen=True)
class Crossed:
    """Every node of the job stands at the fence before `following` (several nodes only);
    `through`: the newest command generation any node had seen when it arrived."""

    following: Phase
    through: int = 0


@dataclass(frozen=True)
class Requested:
    """An operator asked for pause, resume, drain or stop."""

    request: Request


@dataclass(frozen=True)
class StepsChanged:
    """The operator reloaded a config with a new number of steps for the job."""

    max_steps: int


@dataclass(frozen=True)
class Commanded:
    """An operator's command, as read from the job store: `generation` orders them."""

    generation: int
    command: Requested | StepsChanged


@dataclass(frozen=True)
class Drained:
    """The driver finished draining: no phase in flight, nothing more will start."""


@dataclass(frozen=True)
class Failed:
    """Something failed that the job cannot go on from: what, in words, and where."""

    error: str
    blame: Blame | None = None


Event: TypeAlias = (
    Bootstrapped
    | RankFinished
    | BarrierChecked
    | PauseChecked
    | Crossed
    | Requested
    | StepsChanged
    | Commanded
    | Drained
    | Failed
)
# Events that come from an operator: one the machine refuses is the operator's mistake (logged
# and skipped), while a refused event of the driver's own is a bug in the driver.
OPERATOR_EVENTS = (Requested, StepsChanged, Commanded)


_FIELDS: dict[type, Callable[[Any], str]] = {
    RankFinished: lambda e: f"(rank {e.rank}, {e.phase.value})",
    BarrierChecked: lambda e: f"(rank {e.rank}, {e.held_mb:g} MiB held)",
    Requested: lambda e: f"({e.request.value})",
    Bootstrapped: lambda e: f"(step {e.step})",
    StepsChanged: lambda e: f"(max_steps {e.max_steps})",
    Crossed: lambda e: f"(before {e.following.value}, commands through {e.through})",
    Commanded: lambda e: f"({e.generation}: {type(e.command).__name__} {describe(e.command)})",
}


def describe(event: Event) -> str:
    """The event's fields, in words, for error messages."""
    fields = _FIELDS.get(type(event))
    return "" if fields is None else fields(event)
