"""A command's params as they cross the lane (protocols/commands/params.py): what the driver
encodes is what the worker decodes, and what does not decode is named."""

from __future__ import annotations

import msgspec
import pytest

from timeshare.engines.base import RolloutSample
from timeshare.engines.worker import _decoded_samples, _encoded
from timeshare.errors import ProtocolError
from timeshare.protocols.commands import params


def test_a_phase_with_its_batch_arrives_as_sent_and_none_is_no_params() -> None:
    samples = [RolloutSample("r0", (3, 4), (-0.5, -0.25), 7, prompt_tokens=(1, 2))]
    sent = params.PhaseParams(step=7, batch=_encoded(samples))
    got = params.decode(params.encode(sent), params.PhaseParams, "train")
    assert got.step == 7
    assert _decoded_samples(got.batch) == samples
    nothing = params.decode(params.encode(None), params.PhaseParams, "held")
    assert nothing.step is None
    assert _decoded_samples(nothing.batch) == []


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (msgspec.msgpack.encode({"step": 1.5}), "Expected `int | null`, got `float` - at `$.step`"),
        (msgspec.msgpack.encode({"steps": 1}), "Object contains unknown field `steps`"),
        (msgspec.msgpack.encode([1]), "Expected `object`, got `array`"),
        (b"\xc1", "invalid"),
    ],
)
def test_params_that_do_not_decode_are_a_protocol_error_naming_the_command(
    raw: bytes, said: str
) -> None:
    with pytest.raises(ProtocolError, match="bad params for sync") as failed:
        params.decode(msgspec.Raw(raw), params.PhaseParams, "sync")
    assert said in str(failed.value)


def test_a_batch_that_is_no_list_of_samples_is_named() -> None:
    with pytest.raises(ProtocolError, match="bad params for train: batch: Expected `array`"):
        _decoded_samples(msgspec.Raw(msgspec.msgpack.encode({"a": 1})))
