"""The phase machine's table as a Mermaid state diagram: what `timeshare state diagram` prints."""

from __future__ import annotations

from timeshare.state.machine import FIRST_PHASE, MEMORY_FENCES, NEXT_PHASE, TABLE, Lifecycle


def mermaid() -> str:
    """Every legal lifecycle move of TABLE, and the phase cycle inside RUNNING with its fences."""
    lines = ["stateDiagram-v2", f"    [*] --> {Lifecycle.STARTING.value}"]
    for (source, event), targets in TABLE.items():
        for target in sorted(targets, key=lambda t: t.value):
            lines.append(f"    {source.value} --> {target.value}: {event.__name__}")
    lines.append(f"    {Lifecycle.STOPPED.value} --> [*]")
    lines.append(f"    {Lifecycle.FAILED.value} --> [*]")
    lines.append(f"    state {Lifecycle.RUNNING.value} {{")
    lines.append(f"        [*] --> {FIRST_PHASE.value}: bootstrap")
    for phase, following in NEXT_PHASE.items():
        label = "RankFinished, fence: every rank" if following in MEMORY_FENCES else "RankFinished"
        lines.append(f"        {phase.value} --> {following.value}: {label}")
    lines.append("    }")
    return "\n".join(lines) + "\n"
