"""Units the whole package shares, so that a figure means the same thing everywhere."""

from __future__ import annotations

from typing import Annotated

import msgspec

MIB = 1 << 20  # bytes in a MiB: device memory and staging sizes are given in MiB
# The longest deadline any setting may give: a week. Longer is no deadline at all.
MAX_DEADLINE_S = 7 * 24 * 3600
# A duration in seconds: positive and finite (at most a week); inf would be a wait without end.
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_DEADLINE_S)]


def gbps(nbytes: int, seconds: float) -> float:
    """A transfer rate in gigabytes (1e9 bytes) per second; 0 for a transfer that took no time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
