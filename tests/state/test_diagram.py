"""`timeshare state diagram [job|service]` prints each table, and the docs show what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from timeshare.state import TABLE
from timeshare.state import service as service_table
from timeshare.state.diagram import job_mermaid, requests_table, service_mermaid

DOCS = Path(__file__).resolve().parents[2] / "docs"


def mermaid_block(text: str) -> str:
    return text.split("```mermaid\n", 1)[1].split("```", 1)[0]


def test_every_job_table_entry_is_drawn() -> None:
    diagram = job_mermaid()
    for (source, event), targets in TABLE.items():
        for target in targets:
            assert f"    {source.value} --> {target.value}: {event.__name__}\n" in diagram


def test_every_service_table_entry_is_drawn() -> None:
    diagram = service_mermaid()
    for (source, event), targets in service_table.TABLE.items():
        for target in targets:
            assert f"    {source.value} --> {target.value}: {event.__name__}\n" in diagram
    for final in service_table.FINAL:
        assert f"    {final.value} --> [*]\n" in diagram


@pytest.mark.parametrize(("which", "draw"), [("job", job_mermaid), ("service", service_mermaid)])
def test_the_command_prints_each_diagram(which: str, draw: object) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "timeshare", "state", "diagram", which],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert callable(draw) and result.stdout == draw()


def test_the_docs_include_the_current_diagrams() -> None:
    job = (DOCS / "phase-machine.md").read_text()
    assert mermaid_block(job) == job_mermaid(), (
        "docs/phase-machine.md is stale: regenerate with `timeshare state diagram job`"
    )
    service = (DOCS / "service-lifecycle.md").read_text()
    assert mermaid_block(service) == service_mermaid(), (
        "docs/service-lifecycle.md is stale: regenerate with `timeshare state diagram service`"
    )
    assert requests_table() in service, "docs/service-lifecycle.md: the requests table is stale"
