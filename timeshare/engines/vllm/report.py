"""What the timeshare backend in vLLM's worker tells the rollout worker about the last version.

The backend (backend.py) keeps a `BackendReport` of each whole version it received; the rollout
worker reads it by method name (`collective_rpc("timeshare_report")`, engine.py). It crosses
vLLM's own RPC as msgpack bytes (`encode`): vLLM's encoder passes bytes through as they are,
and `decode` checks the shape on arrival. No dict read by string keys, no field copied by hand.

No vLLM and no torch here: both ends import it.
"""

from __future__ import annotations

import msgspec

from timeshare.errors import TimeshareError
from timeshare.protocols.weights.config import TransferReport

# How the backend's `LoaderFailed` begins. vLLM's RPC brings a worker's exception back to the
# rollout worker as a plain Exception holding only its message: this is how the rollout worker
# tells a loader's refusal apart, to raise it typed again (engine.py).
LOADER_REFUSED = "vLLM's loader of"


class LoadSeconds(msgspec.Struct, kw_only=True):
    """Where a version's time went inside vLLM's worker, summed over its buckets (seconds):
    hashing what arrived (`digest_s`), copying it out of staging (`copy_s`), the model's
    `load_weights` (`load_s`) and vLLM's post-load processing (`finalize_s`).

    Mutable: the backend adds to it bucket by bucket."""

    digest_s: float = 0.0
    copy_s: float = 0.0
    load_s: float = 0.0
    finalize_s: float = 0.0


class BackendReport(msgspec.Struct, frozen=True, kw_only=True):
    """One whole version as vLLM's worker received it: the channel's report (`transfer`), the
    digest of what arrived at the model's loader ("" when not asked for), the whole
    `update_weights` call (`call_s`) and where its time went (`spent`)."""

    transfer: TransferReport
    digest: str
    call_s: float
    spent: LoadSeconds

    def encode(self) -> bytes:
        """As it crosses vLLM's RPC."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: object) -> BackendReport:
        """What `encode` made; anything else is a TimeshareError (vLLM's answer, not ours)."""
        if not isinstance(data, bytes):
            raise TimeshareError(f"timeshare_report answered a {type(data).__name__}, not bytes")
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise TimeshareError(f"timeshare_report answered no BackendReport: {exc}") from exc
