"""Both tables as Mermaid state diagrams: what `timeshare state diagram [job|service]` prints.

docs/phase-machine.md and docs/service-lifecycle.md include them; a test checks that they are
current.
"""

from __future__ import annotations

from timeshare.state import service
from timeshare.state.events import Lifecycle, Request
from timeshare.state.job import FIRST_PHASE, MEMORY_FENCES, NEXT_PHASE
from timeshare.state.machine import TABLE


def job_mermaid() -> str:
    """Every legal lifecycle move of the phase machine, and the phase cycle inside RUNNING."""
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


def service_mermaid() -> str:
    """Every legal move of the service's lifecycle (the daemon exits from the final states)."""
    lines = ["stateDiagram-v2", f"    [*] --> {service.S.STARTING.value}"]
    lines.append(f"    [*] --> {service.S.IDLE.value}: socket-activated")
    for (source, event), targets in service.TABLE.items():
        for target in sorted(targets, key=lambda t: t.value):
            lines.append(f"    {source.value} --> {target.value}: {event.__name__}")
    for final in sorted(service.FINAL, key=lambda s: s.value):
        lines.append(f"    {final.value} --> [*]")
    return "\n".join(lines) + "\n"


def requests_table() -> str:
    """The operator requests of the service, per state, as a Markdown table."""
    states = list(service.ServiceLifecycle)
    lines = [
        "| request | " + " | ".join(s.value for s in states) + " |",
        "|---|" + "---|" * len(states),
    ]
    for request in Request:
        answers = service.REQUESTS[request]
        lines.append(f"| {request.value} | " + " | ".join(answers[s].value for s in states) + " |")
    return "\n".join(lines) + "\n"


DIAGRAMS = {"job": job_mermaid, "service": service_mermaid}
