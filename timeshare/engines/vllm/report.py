"""What the timeshare backend in vLLM's worker tells the rollout worker about the last version.

The backend (backend.py) keeps a `LoadReport` (engines/load_report.py) of each whole version it
received; the rollout worker reads it by method name (`collective_rpc("timeshare_report")`,
engine.py). It crosses vLLM's own RPC as msgpack bytes: vLLM's encoder passes bytes through as
they are, and `LoadReport.decode` checks the shape on arrival.

With tensor parallelism each TP worker keeps its own report; `worker_reports` checks that all
of them are there, in order, of one version.

No vLLM and no torch here: both ends import it.
"""

from __future__ import annotations

from collections.abc import Sequence

from timeshare.engines.load_report import LoadReport, worker_reports_checked
from timeshare.errors import TimeshareError

# How the backend's `LoaderFailed` begins. vLLM's RPC brings a worker's exception back to the
# rollout worker as a plain Exception holding only its message: this is how the rollout worker
# tells a loader's refusal apart, to raise it typed again (engine.py).
LOADER_REFUSED = "vLLM's loader of"
REPORT_SOURCE = "vLLM's timeshare_report"


def worker_reports(answers: Sequence[object], rank: int, workers: int) -> list[LoadReport]:
    """Every TP worker's report of the version just received, in TP-rank order, checked: one
    answer per worker, each a whole version (None: that worker's transfer failed), each from
    the worker it stands for, all of the same version."""
    who = f"vLLM rollout rank {rank}"
    if len(answers) != workers:
        raise TimeshareError(
            f"{who}: {REPORT_SOURCE} answered for {len(answers)} workers, the engine has {workers}"
        )
    reports = []
    for worker, answer in enumerate(answers):
        if answer is None:
            raise TimeshareError(
                f"{who}: TP worker {worker} has no report of the version it just received"
            )
        reports.append(LoadReport.decode(answer, f"{REPORT_SOURCE} of TP worker {worker}"))
    return worker_reports_checked(reports, who)
