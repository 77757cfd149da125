"""An SGLang rollout engine in a process of its own, for the tests that kill parts of it.

    python -m tests.engines.sglang.host RUNTIME_DIR ENDPOINT

Prints one JSON line per event on stdout: `ready` (with the pids of SGLang's processes), then
`received` for each version that arrived, or `error` (type, message) when receiving failed,
after which it exits 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.engines.sglang.conftest import MODEL, SPEC, TRANSFER
from timeshare.engines.sglang.engine import SglangRollout
from timeshare.runtime import process_tree


def say(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> int:
    runtime_dir, endpoint = Path(sys.argv[1]), sys.argv[2]
    rollout = SglangRollout(0, SPEC, MODEL, call_timeout_s=120.0, runtime_dir=runtime_dir)
    try:
        inlet = rollout.open_inlet(endpoint, TRANSFER)
        say(event="ready", sglang=rollout._children, tree=process_tree(os.getpid())[1:])
        while True:
            rollout.begin_weight_update()
            try:
                report = inlet.receive(lambda: None)
            except Exception as exc:
                say(event="error", type=type(exc).__name__, message=str(exc))
                return 1
            say(event="received", version=report.version)
    finally:
        rollout.close()


if __name__ == "__main__":
    sys.exit(main())
