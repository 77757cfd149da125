"""What every rollout engine promises the cycle, held for each engine of the registry.

One test per promise; each runs once per engine (conftest.py). An engine that cannot keep a
promise on this platform says so in `traits()`, and the test checks what it says instead of
skipping: vLLM on CPU releases nothing on sleep (`releases_memory` False), so its `held_mb` is 0
and `resident_mb` shows what stays; a text model honours no multimodal input (`inputs`), so a
request with one is refused, naming the field; a bounded sequence (`max_tokens`) refuses a
longer prompt, naming the request.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from tests.engines.contract.conftest import ROLLOUTS, kinds
from tests.engines.contract.rollouts import COMPLETION, RolloutHarness, sampling
from timeshare.engines import registry
from timeshare.engines.base import (
    RolloutEngine,
    RolloutRequest,
    RolloutSample,
    finish_reason,
    until_stop,
)
from timeshare.engines.digest import digest_of, weights_digest
from timeshare.engines.inlet import LocalInlet
from timeshare.errors import (
    GenerateTimeout,
    LoaderFailed,
    PeerError,
    PromptTooLong,
    UnsupportedInput,
    WeightsTorn,
)
from timeshare.protocols.commands.results import WorkerLoad
from timeshare.protocols.weights.layout import Weight
from timeshare.task.vocab import EOS

# Every optional field of a request, as a request that sets it.
OPTIONAL_INPUTS: dict[str, dict[str, object]] = {
    "images": {"images": ("a picture",)},
    "videos": {"videos": ("a film",)},
    "processor_output": {"processor_output": {"pixel_values": [[0.0]], "image_grid_thw": [1]}},
}


def test_the_suite_holds_every_registered_rollout_engine() -> None:
    assert kinds(ROLLOUTS) == set(registry.kinds("rollout"))


def test_it_is_built_through_the_registry_and_refuses_to_generate_before_a_whole_version(
    rollout_engine: RolloutHarness,
) -> None:
    engine = rollout_engine.engine
    assert isinstance(engine, RolloutEngine)
    builder = registry.find(rollout_engine.kind, "rollout").rollout
    assert type(engine).__module__ == builder.partition(":")[0]
    assert isinstance(rollout_engine.before_first_version, WeightsTorn)
    engine.begin_weight_update()  # a transfer begins: the weights are torn until it ends
    with pytest.raises(WeightsTorn):
        engine.generate(rollout_engine.requests(seed=1))
    rollout_engine.sync(0)
    assert len(engine.generate(rollout_engine.requests(seed=1))) == len(rollout_engine.requests(1))


def test_weights_arrive_bit_for_bit_under_the_trainers_names(
    tp_rollout_engine: RolloutHarness,
) -> None:
    engine = tp_rollout_engine.engine
    for variant in (1, 0):  # another trainer's weights, then the first one's again
        weights = tp_rollout_engine.weights(variant)
        sent, received = tp_rollout_engine.sync(variant).reports()
        assert (received.version, received.tensors, received.bytes) == (
            sent.version,
            sent.tensors,
            sent.bytes,
        )
        assert received.tensors == len(weights) and received.buckets > 1
        assert engine.digest() == weights_digest(tensors(weights))
        assert engine.weight_version == sent.version and not engine.torn
    assert weights_digest(tensors(tp_rollout_engine.weights(1))) != engine.digest()


def test_every_worker_of_the_engine_loads_every_version_whole(
    tp_rollout_engine: RolloutHarness,
) -> None:
    """An engine whose weights load in its own processes (vLLM's and SGLang's workers, one per
    tensor-parallel rank) reports what each worker's loader got; each holds the trainer's
    weights bit for bit. One that loads in the worker's process (a `LocalInlet`) has no worker
    to report: its one loader is the engine itself, which holds them so."""
    engine = tp_rollout_engine.engine
    workers = tp_rollout_engine.spec.rollout_workers()
    weights = tp_rollout_engine.weights(tp_rollout_engine.variant)
    sent, received = tp_rollout_engine.sync(tp_rollout_engine.variant).reports()
    loads, tables = engine.worker_loads, engine.worker_tables
    if isinstance(tp_rollout_engine.inlet, LocalInlet):
        assert (workers, loads, tables) == (1, [], {}), loads
        loads = [WorkerLoad(0, received.bytes, engine.digest())]
        tables = {0: engine.table()}
    assert [load.worker for load in loads] == list(range(workers))
    assert [load.digest for load in loads] == [weights_digest(tensors(weights))] * workers
    assert [load.bytes for load in loads] == [sent.bytes] * workers
    # The per-tensor lines each digest is of, kept to name a differing tensor: the trainer's.
    lines = digest_of(tensors(weights)).table()
    assert len(lines) == len(list(tensors(weights)))
    assert tables == dict.fromkeys(range(workers), lines)
    assert engine.table() == lines


def test_seeded_generation_is_reproducible(rollout_engine: RolloutHarness) -> None:
    engine = rollout_engine.engine
    first = engine.generate(rollout_engine.requests(seed=7))
    other = engine.generate(rollout_engine.requests(seed=8))
    assert engine.generate(rollout_engine.requests(seed=7)) == first
    if rollout_engine.family == "causal_lm":  # it samples: the seed is what makes it repeat
        assert [s.tokens for s in other] != [s.tokens for s in first]
        # each request of a batch has its own stream: a group of one prompt is not one sample
        group = [RolloutRequest(f"g{i}", first[0].prompt_tokens, sampling(7)) for i in range(8)]
        assert len({s.tokens for s in engine.generate(group)}) > 1


def test_each_sample_carries_its_version_and_the_logprobs_of_its_tokens(
    tp_rollout_engine: RolloutHarness,
) -> None:
    engine = tp_rollout_engine.engine
    requests = tp_rollout_engine.requests(seed=3)
    by_variant: dict[int, list[RolloutSample]] = {}
    for variant in (0, 1):
        version = tp_rollout_engine.sync(variant).reports()[0].version
        samples = engine.generate(requests)
        assert [s.request_id for s in samples] == [r.request_id for r in requests]
        for sample, request in zip(samples, requests, strict=True):
            assert sample.weight_version == version
            assert sample.prompt_tokens == request.prompt_tokens
            assert len(sample.tokens) == len(sample.logprobs) == request.sampling.max_tokens
            assert all(math.isfinite(p) and p <= 0.0 for p in sample.logprobs)
        trainer = tp_rollout_engine.trainer(variant)
        gap = logprob_gap(samples, trainer.logprobs(samples))
        assert gap <= tp_rollout_engine.logprob_tolerance, (variant, gap)
        by_variant[variant] = samples
    if tp_rollout_engine.family == "causal_lm":  # the version is the weights that sampled them
        other = tp_rollout_engine.trainer(0).logprobs(by_variant[1])
        assert logprob_gap(by_variant[1], other) > 100 * tp_rollout_engine.logprob_tolerance


def test_prompts_of_three_lengths_share_a_batch(rollout_engine: RolloutHarness) -> None:
    """The task's batch: each sample answers its own prompt, whatever its neighbours' lengths,
    with a logprob per token, ending as its finish_reason says."""
    engine = rollout_engine.engine
    requests = rollout_engine.prompts_of_three_lengths(seed=6, stop=(EOS,))
    assert len({len(r.prompt_tokens) for r in requests}) == 3
    samples = engine.generate(requests)
    assert [s.request_id for s in samples] == [r.request_id for r in requests]
    for sample, request in zip(samples, requests, strict=True):
        assert sample.prompt_tokens == request.prompt_tokens
        assert 1 <= len(sample.tokens) == len(sample.logprobs) <= COMPLETION
        assert all(math.isfinite(p) and p <= 0.0 for p in sample.logprobs)
        assert_finished_as_said(sample, request)
    if rollout_engine.family == "causal_lm":  # each row was sampled after its own prompt
        trainer = rollout_engine.trainer(rollout_engine.variant)
        gap = logprob_gap(samples, trainer.logprobs(samples))
        assert gap <= rollout_engine.logprob_tolerance, gap


def test_a_completion_ends_at_its_first_stop_token_and_at_no_other(
    rollout_engine: RolloutHarness,
) -> None:
    """Sampled again with the same seed and a stop set, each completion is the one sampled
    without, cut after the first of its stop tokens (kept, with its logprob: "stop"), or whole
    ("length", max_tokens tokens). No engine stops at a token of its own: the model's EOS ends
    nothing unless the request asks (vLLM and SGLang would add it)."""
    if rollout_engine.family != "causal_lm":
        pytest.skip("the simulated engine samples nothing: its completions are fixed")
    engine = rollout_engine.engine
    # An engine that reads its model's EOS reads the job's (model_dir.py `write_config_dir`)...
    assert rollout_engine.model_eos() in (frozenset(), {EOS})
    seed, free, other = _unstopped_batch_with_two_stop_sets(rollout_engine)
    # ...and it came up inside a completion that went on: nothing but the request stops one.
    assert any(EOS in s.tokens[:-1] for s in free)
    for stop in ((EOS,), (other,)):
        requests = rollout_engine.requests(seed=seed, max_tokens=STOPS_OVER, stop=stop)
        samples = engine.generate(requests)
        for sample, request, unstopped in zip(samples, requests, free, strict=True):
            kept = until_stop(list(unstopped.tokens), stop)
            assert sample.tokens == unstopped.tokens[:kept], (stop, sample, unstopped)
            tolerance = rollout_engine.logprob_tolerance
            assert sample.logprobs == pytest.approx(unstopped.logprobs[:kept], abs=tolerance)
            assert_finished_as_said(sample, request)
        reasons = {s.finish_reason for s in samples}
        assert reasons == {"stop", "length"}, (stop, reasons)


def test_a_generate_past_its_deadline_is_aborted_and_the_engine_stays_usable(
    rollout_engine: RolloutHarness,
) -> None:
    engine = rollout_engine.engine
    expected = engine.generate(rollout_engine.requests(seed=5))
    deadline = engine.generate_timeout_s
    engine.generate_timeout_s = 1e-4  # passes within the first tokens of the longest generate
    try:
        started = time.monotonic()
        with pytest.raises(GenerateTimeout, match="aborted"):
            engine.generate(rollout_engine.long_generate())
        assert time.monotonic() - started < 10.0
    finally:
        engine.generate_timeout_s = deadline
    assert rollout_engine.unfinished() == 0
    assert engine.generate(rollout_engine.requests(seed=5)) == expected


def test_sleep_releases_what_held_mb_counted_and_resident_mb_says_what_stays(
    rollout_engine: RolloutHarness,
) -> None:
    engine = rollout_engine.engine
    requests = rollout_engine.requests(seed=2)
    before = engine.generate(requests)
    held, resident = engine.held_mb(), engine.resident_mb()
    if engine.traits().releases_memory:
        witness = rollout_engine.witness()
        assert held > 0 and witness.held_mb() == pytest.approx(held)
        engine.sleep()
        assert engine.held_mb() == 0.0
        assert witness.held_mb() == 0.0  # what it said it released, it released
        assert engine.resident_mb() == resident
        engine.wake({"weights", "kv_cache"})
        rollout_engine.sync(rollout_engine.variant)  # released weights come back by SYNC
        assert engine.held_mb() == pytest.approx(rollout_engine.witness().held_mb())
        assert engine.held_mb() > 0
    else:  # it says it can release nothing here: held_mb is 0, resident_mb what stays
        assert held == 0.0 and resident > 0
        engine.sleep()
        assert (engine.held_mb(), engine.resident_mb()) == (0.0, resident)
        engine.wake({"weights", "kv_cache"})
        assert (engine.held_mb(), engine.resident_mb()) == (0.0, resident)
        assert not engine.torn  # what stayed is the version it had: served without a SYNC
    assert engine.generate(requests) == with_version(before, engine.weight_version)


def test_a_loader_failure_is_a_typed_error_naming_the_engine_until_a_whole_version_comes(
    tp_rollout_engine: RolloutHarness,
) -> None:
    engine = tp_rollout_engine.engine
    variant = tp_rollout_engine.variant
    weights = tp_rollout_engine.weights(variant)
    requests = tp_rollout_engine.requests(seed=4)
    expected = engine.generate(requests)
    for broken in (misnamed(weights), misshapen(weights)):
        outcome = tp_rollout_engine.attempt(broken)
        assert isinstance(outcome.sent, PeerError), outcome.sent  # the trainer's side
        assert outcome.sent.remote_type == "LoaderFailed"
        assert isinstance(outcome.received, LoaderFailed), outcome.received  # the rollout's
        for message in (outcome.sent.remote_message, str(outcome.received)):
            assert tp_rollout_engine.loader_name in message
        with pytest.raises(WeightsTorn):
            engine.generate(requests)
        tp_rollout_engine.sync(variant)  # a new session after the failed one: whole again
        assert engine.digest() == weights_digest(tensors(weights))
        assert engine.generate(requests) == with_version(expected, engine.weight_version)


def test_inputs_it_cannot_honour_are_refused_by_name(rollout_engine: RolloutHarness) -> None:
    engine = rollout_engine.engine
    declared = engine.traits().inputs
    assert declared <= set(OPTIONAL_INPUTS)
    plain = RolloutRequest("plain", (10, 1, 11), sampling(1))
    for field, value in OPTIONAL_INPUTS.items():
        request = RolloutRequest(f"with-{field}", (10, 2, 11), sampling(1), **value)  # type: ignore[arg-type]
        if field in declared:
            [sample] = engine.generate([request])
            assert sample.request_id == request.request_id
            continue
        with pytest.raises(UnsupportedInput) as refused:
            engine.generate([plain, request])  # the whole batch is refused, before sampling
        assert not isinstance(refused.value, PromptTooLong)
        assert field in str(refused.value) and repr(request.request_id) in str(refused.value)
    assert len(engine.generate([plain])) == 1


def test_a_prompt_longer_than_it_holds_is_refused_by_name(rollout_engine: RolloutHarness) -> None:
    engine = rollout_engine.engine
    limit = engine.traits().max_tokens

    def prompt(length: int) -> tuple[int, ...]:
        return tuple(i % 10 for i in range(length))

    if limit is None:  # no limit: a long prompt is served whole
        [sample] = engine.generate([RolloutRequest("long", prompt(4096), sampling(1))])
        assert len(sample.tokens) == COMPLETION
        return
    fits = RolloutRequest("fits", prompt(limit - COMPLETION), sampling(1))
    [sample] = engine.generate([fits])
    assert len(sample.tokens) == COMPLETION
    for over in (
        RolloutRequest("over", prompt(limit - COMPLETION + 1), sampling(1)),
        RolloutRequest("asks-too-much", prompt(3), sampling(1, max_tokens=limit - 2)),
    ):
        with pytest.raises(PromptTooLong) as refused:
            engine.generate([over])
        assert repr(over.request_id) in str(refused.value)
    assert len(engine.generate([fits])) == 1


# -- helpers ----------------------------------------------------------------------------------


STOPS_OVER = 8  # the completion the stop tests sample (every engine's sequence holds it)
SEEDS_TRIED = 10  # batches sampled to find one that a stop set splits (almost any does)


def _unstopped_batch_with_two_stop_sets(
    harness: RolloutHarness,
) -> tuple[int, list[RolloutSample], int]:
    """A seed and its batch sampled with no stop tokens, in which EOS and another token each
    come up before the last position of some completions and in none of others: as a stop set,
    each ends some completions early and leaves others whole."""
    vocab = harness.spec.served_model().config.vocab_size
    seen = []
    for seed in range(SEEDS_TRIED):
        requests = harness.requests(seed=seed, max_tokens=STOPS_OVER)
        free = harness.engine.generate(requests)
        for sample, request in zip(free, requests, strict=True):
            assert len(sample.tokens) == len(sample.logprobs) == STOPS_OVER, sample
            assert_finished_as_said(sample, request)
        seen.append([s.tokens for s in free])
        others = [t for t in range(vocab) if t != EOS and _splits(free, t)]
        if _splits(free, EOS) and others:
            return seed, free, others[0]
    raise AssertionError(f"no batch of {SEEDS_TRIED} that a stop set splits: {seen}")


def _splits(samples: list[RolloutSample], token: int) -> bool:
    """`token` ends some of `samples` early (before their last position) and none of others."""
    return any(token in s.tokens[:-1] for s in samples) and any(
        token not in s.tokens for s in samples
    )


def assert_finished_as_said(sample: RolloutSample, request: RolloutRequest) -> None:
    """Its finish_reason is what its tokens say: "stop" ends at its first stop token (none
    before it), "length" holds max_tokens tokens and no stop token."""
    stops = request.sampling.stop_token_ids
    assert sample.finish_reason == finish_reason(sample.tokens, stops), sample
    assert until_stop(list(sample.tokens), stops) == len(sample.tokens), sample
    if sample.finish_reason == "length":
        assert len(sample.tokens) == request.sampling.max_tokens, sample


def tensors(weights: list[tuple[str, Weight]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, weight in weights:
        assert isinstance(weight, torch.Tensor), name
        out.append((name, weight))
    return out


def misnamed(weights: list[tuple[str, Weight]]) -> list[tuple[str, Weight]]:
    """The last weight under a name no engine loads."""
    name, tensor = weights[-1]
    return [*weights[:-1], (f"surplus.{name}", tensor)]


def misshapen(weights: list[tuple[str, Weight]]) -> list[tuple[str, Weight]]:
    """One weight of the wrong shape: a matrix transposed, or else a vector halved."""
    out = tensors(weights)
    index = next(
        (i for i, (_, t) in enumerate(out) if t.dim() == 2 and t.shape[0] != t.shape[1]), 0
    )
    name, tensor = out[index]
    wrong = tensor.t().contiguous() if tensor.dim() == 2 else tensor[: tensor.numel() // 2].clone()
    return [*out[:index], (name, wrong), *out[index + 1 :]]


def logprob_gap(samples: list[RolloutSample], expected: list[tuple[float, ...]]) -> float:
    return max(
        abs(a - b)
        for sample, row in zip(samples, expected, strict=True)
        for a, b in zip(sample.logprobs, row, strict=True)
    )


def with_version(samples: list[RolloutSample], version: int | None) -> list[RolloutSample]:
    """`samples` as the same weights sample them again under another version number."""
    assert version is not None
    return [dataclasses.replace(s, weight_version=version) for s in samples]
