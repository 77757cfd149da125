"""What an engine's own process, where weights load, tells the rollout worker about a version.

vLLM's workers and SGLang's scheduler each receive a version through the weight channel inside
the engine (engines/vllm/backend.py, engines/sglang/loader.py) and keep a `LoadReport` of it;
the rollout worker reads it back (vLLM: through its RPC, by method name; SGLang: from a file
the loader writes) as msgpack bytes, checked on arrival. No dict read by string keys.

No engine and no torch here: both ends import it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from timeshare.errors import TimeshareError
from timeshare.protocols.weights.config import TransferReport


class LoadSeconds(msgspec.Struct, kw_only=True):
    """Where a version's time went inside the engine, summed over its buckets (seconds):
    hashing what arrived (`digest_s`), copying it out of staging (`copy_s`), the model's
    `load_weights` (`load_s`) and the engine's post-load processing (`finalize_s`).

    Mutable: the loader adds to it bucket by bucket."""

    digest_s: float = 0.0
    copy_s: float = 0.0
    load_s: float = 0.0
    finalize_s: float = 0.0


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """One whole version as the engine's process received it: the channel's report
    (`transfer`), the digest of what arrived at the model's loader ("" when not asked for) and
    its per-tensor lines (`tensors`: kept by the rollout worker, read only when the digest
    differs from the trainer's), the whole receiving call (`call_s`) and where its time went
    (`spent`)."""

    transfer: TransferReport
    digest: str
    call_s: float
    spent: LoadSeconds
    worker: int = 0  # the engine's tensor-parallel rank that loaded it
    tensors: dict[str, str] = {}  # name -> "dtype|shape|hash" (engines/digest.py)

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: object, source: str) -> LoadReport:
        """What `encode` made; anything else is a TimeshareError naming `source` (the engine's
        answer, not ours)."""
        if not isinstance(data, bytes):
            raise TimeshareError(f"{source} answered a {type(data).__name__}, not bytes")
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise TimeshareError(f"{source} answered no LoadReport: {exc}") from exc


def worker_reports_checked(reports: Sequence[LoadReport], who: str) -> list[LoadReport]:
    """The reports of an engine's tensor-parallel workers, in TP-rank order, checked: each
    from the worker it stands for, all of one version (`who`: the engine, for errors)."""
    for worker, report in enumerate(reports):
        if report.worker != worker:
            raise TimeshareError(
                f"{who}: the report in TP worker {worker}'s place is worker {report.worker}'s"
            )
    versions = [report.transfer.version for report in reports]
    if len(set(versions)) != 1:
        raise TimeshareError(f"{who}: TP workers received different versions: {versions}")
    return list(reports)
