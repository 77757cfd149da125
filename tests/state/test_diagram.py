"""`timeshare state diagram` prints the table, and the docs show what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from timeshare.state import TABLE
from timeshare.state.diagram import mermaid

DOCS = Path(__file__).resolve().parents[2] / "docs" / "state.md"


def test_every_table_entry_is_drawn() -> None:
    diagram = mermaid()
    for (source, event), targets in TABLE.items():
        for target in targets:
            assert f"    {source.value} --> {target.value}: {event.__name__}\n" in diagram


def test_the_command_prints_the_diagram() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "timeshare", "state", "diagram"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout == mermaid()


def test_the_docs_include_the_current_diagram() -> None:
    text = DOCS.read_text()
    block = text.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert block == mermaid(), "docs/state.md is stale: regenerate with `timeshare state diagram`"
