"""The control socket's wire format: newline-delimited JSON, one request per line.

    {"id": 1, "method": "status", "params": {}}
    → {"id": 1, "result": {...}}
    → {"id": 1, "error": {"name": "NotRunning", "message": "...", "state": "idle"}}

`watch` answers with one `{"id": …, "event": {...}}` line per transition until the client
leaves. The id is echoed as given (a number, a string, or null); a request without one gets
`"id": null`. Every way a line can be wrong is a `ControlError` whose `name` says which, so a
client can tell a typo from a refusal. No pickle: JSON only (msgspec), with a size limit per
line that the server sets.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

RequestId = int | str | None
LogLevel = Literal["debug", "info", "warning", "error"]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]


class ControlError(Exception):
    """A request the daemon refuses: `name` is stable for scripts, the message is for people."""

    name = "ControlError"

    def __init__(self, message: str, *, request_id: RequestId = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class BadRequest(ControlError):
    """Raised for a line that is not a JSON object with a string `method`."""

    name = "BadRequest"


class UnknownMethod(ControlError):
    """Raised for a method the daemon does not have."""

    name = "UnknownMethod"


class BadParams(ControlError):
    """Raised for parameters of the wrong name, type or range."""

    name = "BadParams"


class RequestTooLarge(ControlError):
    """Raised for a line longer than the server's limit (the connection is then closed)."""

    name = "RequestTooLarge"


# -- parameters of each method -------------------------------------------------------------------


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class WaitParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`wait`: answer once the request took effect (or `timeout_s` passed)."""

    wait: bool = False
    timeout_s: Seconds = 600.0


class LogLevelParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    level: LogLevel


METHODS: dict[str, type[msgspec.Struct]] = {
    "status": NoParams,
    "pause": WaitParams,
    "resume": NoParams,
    "drain": WaitParams,
    "stop": NoParams,
    "reload": WaitParams,
    "watch": NoParams,
    "set_log_level": LogLevelParams,
}


class Call(msgspec.Struct, frozen=True):
    """A request that parsed: its id, method and typed parameters."""

    id: RequestId
    method: str
    params: Any


class _Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str
    id: RequestId = None
    params: dict[str, Any] = {}


def parse_request(line: bytes) -> Call:
    """One line (without its newline) as a `Call`, or the `ControlError` saying what is wrong."""
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise BadRequest(f"a request is a JSON object, got {type(raw).__name__}")
    request_id = raw.get("id")
    if not isinstance(request_id, int | str | type(None)) or isinstance(request_id, bool):
        raise BadRequest("id must be a number, a string or null")
    try:
        envelope = msgspec.convert(raw, _Envelope)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc), request_id=request_id) from exc
    params_type = METHODS.get(envelope.method)
    if params_type is None:
        raise UnknownMethod(
            f"no method {envelope.method!r}; methods are {', '.join(sorted(METHODS))}",
            request_id=request_id,
        )
    try:
        params = msgspec.convert(envelope.params, params_type)
    except msgspec.ValidationError as exc:
        raise BadParams(f"{envelope.method}: {exc}", request_id=request_id) from exc
    return Call(request_id, envelope.method, params)


def encode_result(request_id: RequestId, result: Any) -> bytes:
    return msgspec.json.encode({"id": request_id, "result": result}) + b"\n"


def encode_event(request_id: RequestId, event: Any) -> bytes:
    return msgspec.json.encode({"id": request_id, "event": event}) + b"\n"


def encode_error(request_id: RequestId, name: str, message: str, state: str) -> bytes:
    error = {"name": name, "message": message, "state": state}
    return msgspec.json.encode({"id": request_id, "error": error}) + b"\n"


# -- refusals of the daemon (the request was well formed) ----------------------------------------


class NotRunning(ControlError):
    """Raised for a request that needs a cycle when none runs (idle, failed)."""

    name = "NotRunning"


class TransitionRefused(ControlError):
    """Raised for a request the job's state does not allow (e.g. resume while draining)."""

    name = "InvalidTransition"


class ReloadRefused(ControlError):
    """Raised when a reloaded config is broken or changes what cannot change live."""

    name = "ReloadRefused"


class WaitTimedOut(ControlError):
    """Raised when `wait` was asked for and the request did not take effect in `timeout_s`."""

    name = "Timeout"


class Busy(ControlError):
    """Raised when the daemon already serves as many clients as it allows."""

    name = "Busy"
