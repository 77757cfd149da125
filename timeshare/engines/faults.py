"""Injected faults, for tests and drills: which worker fails, as which phase starts, and how.

The job config lists them (`[[faults]]`); the worker process fires them (worker.py).
"""

from __future__ import annotations

from typing import Literal

import msgspec

FaultKind = Literal["raise", "hang", "kill"]


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Make `role` of `rank` fail as `phase` (of `step`, or of any step) starts."""

    role: str
    rank: int
    phase: str
    kind: FaultKind
    step: int | None = None
