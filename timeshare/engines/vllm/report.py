"""What the timeshare backend in vLLM's worker tells the rollout worker about the last version.

The backend (backend.py) keeps a `LoadReport` (engines/load_report.py) of each whole version it
received; the rollout worker reads it by method name (`collective_rpc("timeshare_report")`,
engine.py). It crosses vLLM's own RPC as msgpack bytes: vLLM's encoder passes bytes through as
they are, and `LoadReport.decode` checks the shape on arrival.

No vLLM and no torch here: both ends import it.
"""

from __future__ import annotations

# How the backend's `LoaderFailed` begins. vLLM's RPC brings a worker's exception back to the
# rollout worker as a plain Exception holding only its message: this is how the rollout worker
# tells a loader's refusal apart, to raise it typed again (engine.py).
LOADER_REFUSED = "vLLM's loader of"
REPORT_SOURCE = "vLLM's timeshare_report"
