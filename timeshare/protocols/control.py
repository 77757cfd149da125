"""The control socket's wire format: newline-delimited JSON, one request per line.

    {"id": 1, "method": "status", "params": {}}
    → {"id": 1, "result": {...}}
    → {"id": 1, "error": {"name": "NotRunning", "message": "...", "state": "idle"}}

`watch` answers with one `{"id": …, "event": {...}}` line per transition until the client
leaves. The id is echoed as given (a number, a string, or null); a request without one gets
`"id": null`. Every way a line can be wrong, and every refusal, is an error whose `name` is its
class's (errors.py: the `ControlError` family, and `InvalidTransition`), so a client can tell a
typo from a refusal. No pickle: JSON only (msgspec), with a size limit per line that the server
sets.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from timeshare.errors import BadParams, BadRequest, UnknownMethod
from timeshare.levels import LogLevel

RequestId = int | str | None
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]


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
    "reload": NoParams,  # answered once the new config is applied: nothing to wait for
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


def encode_result(request_id: RequestId, result: object) -> bytes:
    return msgspec.json.encode({"id": request_id, "result": result}) + b"\n"


def encode_event(request_id: RequestId, event: object) -> bytes:
    return msgspec.json.encode({"id": request_id, "event": event}) + b"\n"


def encode_error(request_id: RequestId, name: str, message: str, state: str) -> bytes:
    error = {"name": name, "message": message, "state": state}
    return msgspec.json.encode({"id": request_id, "error": error}) + b"\n"


class ServiceStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What `status` answers: where the service and its job stand."""

    lifecycle: str  # the service's lifecycle (state/service.py)
    phases: list[str]  # each rank's phase, while a cycle runs
    step: int | None  # the job's step (the committed one while no cycle runs)
    steps: int  # the job's step limit
    committed_step: int | None
    weight_version: int | None
    last_step: dict[str, object] | None  # the last complete step's figures (cycle/steps.py)
    reason: str | None  # why the job drains, stopped, failed, or the service idles
    uptime_s: float
    pid: int
    ranks: int
    engine: str
    metrics_port: int | None
    log_level: str
    loop_lag_max_ms: float
    node: int = 0  # this daemon's node of the job
    # Several nodes: every node as its daemon last wrote it into the job store (while a cycle
    # runs): node, ranks, host, pid, lifecycle, step, phases, reason, and `beat_age_s`.
    nodes: list[dict[str, object]] = []
