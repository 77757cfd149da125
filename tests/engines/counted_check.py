"""A check for tests/engines/test_child_check.py, run as `python -m` the way engines' checks
are: it notes each time it runs in the file its payload names, and passes unless told to fail."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from timeshare.engines.child_check import answer

if __name__ == "__main__":
    payload = json.loads(sys.argv[1])
    with Path(payload["runs"]).open("a") as runs:
        runs.write("ran\n")
    if payload.get("fail"):
        answer({"ok": False, "error": "engine.fake.key: rejected"})
    else:
        answer({"ok": True})
