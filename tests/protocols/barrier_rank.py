"""One rank of a barrier test in its own process: `python -m tests.protocols.barrier_rank ARGS`.

ARGS (JSON): host, port, rank, world_size and `plan`, a list of [barrier name, timeout_s];
a name in `skip` is not waited on by this rank. Prints one JSON line per barrier.
"""

from __future__ import annotations

import json
import sys

from timeshare.errors import CollectiveTimeout
from timeshare.protocols.barrier import Barrier
from timeshare.protocols.store import JobStore


def main() -> None:
    args = json.loads(sys.argv[1])
    store = JobStore.connect(args["host"], args["port"], timeout_s=30.0)
    barrier = Barrier(store, args["rank"], args["world_size"])
    for name, timeout_s in args["plan"]:
        if name in args.get("skip", []):
            print(json.dumps({"barrier": name, "skipped": True}), flush=True)
            continue
        try:
            generation = barrier.wait_blocking(name, timeout_s=timeout_s)
        except CollectiveTimeout as exc:
            print(json.dumps({"barrier": name, "missing": exc.missing}), flush=True)
        else:
            print(json.dumps({"barrier": name, "generation": generation}), flush=True)


if __name__ == "__main__":
    main()
