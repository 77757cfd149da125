"""What a command carries to a worker, typed: the driver encodes one of these, the worker
decodes it with the type its handler declares (`decode`), so a field of the wrong type or one
the worker does not know is a failure of that call naming the field, never a `KeyError` deep in
an engine. (Its answer comes back the same way: results.py.)"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from timeshare.errors import ProtocolError

P = TypeVar("P")
NO_SAMPLES = msgspec.Raw(msgspec.msgpack.encode([]))  # a batch of none


class PhaseParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every phase command (bootstrap, train, offload, sync, barrier, resume, rollout, held)."""

    step: int | None = None  # the step the phase belongs to (None: bootstrap, held)
    # TRAIN's trainer: this rank's samples as the rollout encoded them (msgpack of
    # list[RolloutSample]), passed through the driver undecoded. (msgspec decodes a Raw field
    # only on its own, not in a union: none is an empty list.)
    batch: msgspec.Raw = NO_SAMPLES


class LogLevelParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The control lane's `log_level`: the operator's new level, while work runs."""

    level: str


def encode(params: object) -> msgspec.Raw:
    """`params` (a Struct above, or anything msgpack encodes; None: none) as a call carries it."""
    return msgspec.Raw(msgspec.msgpack.encode({} if params is None else params))


def decode(raw: msgspec.Raw, kind: type[P], command: str) -> P:
    """A call's params as `kind`; a `ProtocolError` naming the command and what was wrong."""
    try:
        return msgspec.msgpack.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad params for {command}: {exc}") from exc
