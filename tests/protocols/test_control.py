"""The control socket's wire format: what parses, and the error that names what does not."""

from __future__ import annotations

import json

import pytest

from timeshare.errors import BadParams, BadRequest, ControlError, UnknownMethod
from timeshare.protocols.control import (
    LogLevelParams,
    NoParams,
    WaitParams,
    encode_error,
    encode_result,
    parse_request,
)


@pytest.mark.parametrize(
    ("line", "method", "params"),
    [
        (b'{"id": 1, "method": "status"}', "status", NoParams()),
        (b'{"method": "status", "params": {}}', "status", NoParams()),
        (b'{"id": "a", "method": "pause", "params": {"wait": true}}', "pause", WaitParams(True)),
        (
            b'{"id": null, "method": "drain", "params": {"timeout_s": 5}}',
            "drain",
            WaitParams(False, 5.0),
        ),
        (
            b'{"id": 2, "method": "set_log_level", "params": {"level": "debug"}}',
            "set_log_level",
            LogLevelParams("debug"),
        ),
    ],
)
def test_well_formed_requests(line: bytes, method: str, params: object) -> None:
    call = parse_request(line)
    assert (call.method, call.params) == (method, params)


@pytest.mark.parametrize(
    ("line", "error", "words", "request_id"),
    [
        (b"status", BadRequest, "not JSON", None),
        (b"[1, 2]", BadRequest, "JSON object, got list", None),
        (b'{"id": [1], "method": "status"}', BadRequest, "id must be", None),
        (b'{"id": true, "method": "status"}', BadRequest, "id must be", None),
        (b'{"id": 4}', BadRequest, "method", 4),
        (b'{"id": 4, "method": 5}', BadRequest, "method", 4),
        (b'{"id": 4, "method": "status", "extra": 1}', BadRequest, "extra", 4),
        (b'{"id": 5, "method": "explode"}', UnknownMethod, "no method 'explode'", 5),
        (b'{"id": 6, "method": "pause", "params": {"wait": "yes"}}', BadParams, "wait", 6),
        (b'{"id": 6, "method": "pause", "params": {"timeout_s": -1}}', BadParams, "timeout_s", 6),
        (b'{"id": 7, "method": "stop", "params": {"now": true}}', BadParams, "now", 7),
        (
            b'{"id": 8, "method": "set_log_level", "params": {"level": "loud"}}',
            BadParams,
            "level",
            8,
        ),
        (b'{"id": 8, "method": "set_log_level"}', BadParams, "level", 8),
        (b'{"id": 9, "method": "status", "params": [1]}', BadRequest, "params", 9),
    ],
)
def test_bad_requests_name_what_is_wrong(
    line: bytes, error: type[ControlError], words: str, request_id: object
) -> None:
    with pytest.raises(error, match=words) as info:
        parse_request(line)
    assert info.value.request_id == request_id


def test_replies_are_one_json_line() -> None:
    result = encode_result(1, {"lifecycle": "running"})
    assert result.endswith(b"\n") and result.count(b"\n") == 1
    assert json.loads(result) == {"id": 1, "result": {"lifecycle": "running"}}
    error = json.loads(encode_error("x", "NotRunning", "no cycle", "idle"))
    assert error == {
        "id": "x",
        "error": {"name": "NotRunning", "message": "no cycle", "state": "idle"},
    }
