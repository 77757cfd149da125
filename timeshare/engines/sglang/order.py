"""What crosses SGLang's own process boundary for a SYNC: a small order, and the loader's answer.

The rollout worker asks SGLang to run timeshare's loader (loader.py) in its scheduler through
SGLang's `update_weights_from_tensor`, whose request SGLang pickles to its scheduler. So the
request carries no weights: one empty tensor whose *name* is a `LoadOrder` as JSON (where the
trainer's sender is, the channel's settings, where to write the answer). The weights come
through timeshare's channel into the scheduler. The loader writes its answer, a `LoadOutcome`
as msgpack, to the order's `answer_path` (SGLang's reply to that call says only "Success"),
and the rollout worker reads it back, checked on arrival.

No SGLang and no torch here: both ends import it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

from timeshare.engines.load_report import LoadReport
from timeshare.errors import TimeshareError
from timeshare.protocols.weights import TransferConfig

PREFIX = "timeshare-load-order:"  # how an order's name begins (no weight of a model is named so)


class LoadOrder(msgspec.Struct, frozen=True, kw_only=True):
    endpoint: str  # the trainer's weight endpoint for this rank
    transfer: TransferConfig
    begin_timeout_s: float  # the wait for the trainer to begin sending
    digest: bool  # hash what arrives (weights_match); off only to measure the channel
    answer_path: str  # where the loader of TP rank k writes its LoadOutcome (answer_of(k))
    model_dir: str  # the directory SGLang started from (its checkpoint's names, if it has one)
    workers: int = 1  # SGLang's TP ranks: each receives the version as that member of it

    def answer_of(self, worker: int) -> str:
        """Where TP rank `worker`'s loader answers (one answer per rank)."""
        return self.answer_path if self.workers == 1 else f"{self.answer_path}.tp{worker}"

    def as_name(self) -> str:
        return PREFIX + msgspec.json.encode(self).decode()

    @classmethod
    def from_name(cls, name: str) -> LoadOrder:
        if not name.startswith(PREFIX):
            raise TimeshareError(f"timeshare's SGLang loader was given {name[:60]!r}, no order")
        return msgspec.json.decode(name[len(PREFIX) :], type=cls)


class LoadOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """A whole version (`report`), or why not: the model's loader refused a bucket (`loader`)
    or the transfer failed (`transfer`: the channel's error, named)."""

    report: LoadReport | None = None
    failure: Literal["", "loader", "transfer"] = ""
    error: str = ""

    def write(self, path: str) -> None:
        """Atomically: the rollout worker never reads half an answer."""
        partial = Path(f"{path}.partial")
        partial.write_bytes(msgspec.msgpack.encode(self))
        os.replace(partial, path)

    @classmethod
    def read(cls, path: str) -> LoadOutcome:
        """The loader's answer, once: a TimeshareError if there is none or it is not one."""
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError as exc:
            raise TimeshareError(
                "timeshare's SGLang loader left no answer: SGLang did not run it"
            ) from exc
        finally:
            Path(path).unlink(missing_ok=True)
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise TimeshareError(
                f"timeshare's SGLang loader answered no LoadOutcome: {exc}"
            ) from exc
