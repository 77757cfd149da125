"""Every decision about the job, as pure tables: no I/O, no anyio, no time.

events.py    the vocabulary: lifecycles, phases, requests, and the events the driver observes
job.py       where a job stands (`JobState`), and the cycle's phases and fences
machine.py   the phase machine: the job's table and `advance`
plan.py      what the driver performs after each move (`plan`)
service.py   the service's own lifecycle, and how it answers an operator's requests
weights.py   whether every rollout holds its trainer's weights, and what a mismatch does
diagram.py   both tables as Mermaid diagrams (docs/ shows them)
"""

from timeshare.errors import InvalidTransition
from timeshare.state.events import (
    OPERATOR_EVENTS,
    BarrierChecked,
    Blame,
    Bootstrapped,
    Commanded,
    Crossed,
    Drained,
    Event,
    Failed,
    Held,
    Lifecycle,
    PauseChecked,
    Phase,
    RankFinished,
    Request,
    Requested,
    StepsChanged,
)
from timeshare.state.job import MEMORY_FENCES, NEXT_PHASE, JobState, RankProgress, initial_state
from timeshare.state.machine import TABLE, Outcome, advance, applies_at_once
from timeshare.state.plan import Plan, plan

__all__ = [
    "MEMORY_FENCES",
    "NEXT_PHASE",
    "OPERATOR_EVENTS",
    "TABLE",
    "BarrierChecked",
    "Blame",
    "Bootstrapped",
    "Commanded",
    "Crossed",
    "Drained",
    "Event",
    "Failed",
    "Held",
    "InvalidTransition",
    "JobState",
    "Lifecycle",
    "Outcome",
    "PauseChecked",
    "Phase",
    "Plan",
    "RankFinished",
    "RankProgress",
    "Request",
    "Requested",
    "StepsChanged",
    "advance",
    "applies_at_once",
    "initial_state",
    "plan",
]
