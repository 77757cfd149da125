"""The reference engines in one process: model, GRPO, offload, checkpoints, rollout memory."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import msgspec
import pytest
import torch

from timeshare.engines.base import RolloutRequest, RolloutSample, SamplingParams
from timeshare.engines.digest import weights_digest
from timeshare.engines.grpo import figures_kept
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.spec import EngineChoice, check_engines, engine_spec
from timeshare.engines.task import RepeatDigit, TaskWorkload
from timeshare.engines.torch_ref import checkpoint
from timeshare.engines.torch_ref.model import (
    KVCache,
    init_model,
    load_pretrained,
    save_pretrained,
)
from timeshare.engines.torch_ref.rollout import TorchRefRollout
from timeshare.engines.torch_ref.trainer import TorchRefTrainer
from timeshare.errors import ConfigError, EngineAsleep, OffPolicy, WeightsTorn
from timeshare.protocols.commands.results import TrainFigures
from timeshare.task.grpo_math import clipped_loss, group_advantages, token_weights
from timeshare.task.vocab import BOS, EOS, SEP

SPEC = engine_spec(
    trainer="torch_ref",
    rollout="torch_ref",
    task={"prompts_per_rank": 2, "group_size": 4, "max_completion_tokens": 5},
    torch_ref={"kv_cache_len": 16},
)
MODEL = ModelConfig()


def rollout_with(trainer: TorchRefTrainer, spec: EngineChoice = SPEC) -> TorchRefRollout:
    engine = TorchRefRollout(0, spec, MODEL)
    engine.begin_weight_update()
    engine.wake({"weights"})
    engine.load_weights(list(trainer.iter_weights()))
    engine.finish_weight_update(trainer.step)
    engine.mark_whole(trainer.step)  # as its LocalInlet does
    engine.wake({"kv_cache"})
    return engine


def scored_batch(trainer: TorchRefTrainer, step: int = 0) -> list[RolloutSample]:
    workload = TaskWorkload(SPEC.task)
    requests = workload.requests(0, step)
    engine = rollout_with(trainer)
    samples = engine.generate(requests)
    return [
        dataclasses.replace(s, reward=workload.score(r, s))
        for r, s in zip(requests, samples, strict=True)
    ]


@pytest.mark.parametrize("invariant", [False, True], ids=["sdpa", "row-local"])
def test_the_kv_cache_decode_of_prompts_of_differing_lengths_matches_each_row_alone(
    invariant: bool,
) -> None:
    """Prompts of 2, 4 and 3 tokens prefilled right-padded, then decoded each at its own
    position: every row's logits are those of its own full forward, alone (to the bit in the
    batch-invariant mode, which needs strict GEMMs from the process's start: the spawned probes
    of tests/engines/test_batch_invariance.py)."""
    config = ModelConfig(num_key_value_heads=2)  # grouped-query attention too
    model = init_model(config, seed=3)
    model.set_batch_invariant(invariant)
    tokens = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([2, 4, 3])
    with torch.no_grad():
        cache = KVCache(config, batch=3, max_len=16)
        steps = [model.prefill(tokens[:, :4], lengths, cache)]
        for i in range(4):  # row r's next token is tokens[r, lengths[r] + i]
            steps.append(model.decode(tokens[torch.arange(3), lengths + i], cache))
        for row in range(3):
            alone = model(tokens[row : row + 1, : int(lengths[row]) + 4])[0]
            got = torch.stack([step[row] for step in steps])
            want = alone[int(lengths[row]) - 1 :]
            assert torch.allclose(got, want, atol=1e-5), row


def test_init_is_a_function_of_the_seed_and_checkpoints_round_trip(tmp_path: Path) -> None:
    a, b, c = (init_model(ModelConfig(), seed) for seed in (0, 0, 1))
    assert weights_digest(a.named_parameters()) == weights_digest(b.named_parameters())
    assert weights_digest(a.named_parameters()) != weights_digest(c.named_parameters())
    save_pretrained(a, tmp_path / "ckpt")
    loaded = load_pretrained(tmp_path / "ckpt")
    assert weights_digest(loaded.named_parameters()) == weights_digest(a.named_parameters())
    (tmp_path / "ckpt" / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match=r"no pytorch_model\.bin"):
        load_pretrained(tmp_path / "ckpt")


def test_bad_engine_settings_are_refused_naming_the_key() -> None:
    def reference(**sections: object) -> EngineChoice:
        return engine_spec(trainer="torch_ref", rollout="torch_ref", **sections)

    with pytest.raises(ConfigError, match=r"engine\.torch_ref\.model: vocab_size \(8\)"):
        check_engines(reference(torch_ref={"model": {"vocab_size": 8}}))
    with pytest.raises(ConfigError, match=r"engine\.torch_ref\.kv_cache_len \(16\) is shorter"):
        check_engines(reference(task={"max_completion_tokens": 20}, torch_ref={"kv_cache_len": 16}))
    with pytest.raises(ConfigError, match=r"kv_cache_len \(128\) exceeds max_position_embeddings"):
        check_engines(reference(torch_ref={"kv_cache_len": 128}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelConfig(hidden_size=64, num_attention_heads=5)


def test_task_reward_and_advantages() -> None:
    task = RepeatDigit()
    assert task.reward((BOS, 7, SEP), (7, EOS)) == 1.0
    assert task.reward((BOS, 7, 7, 7, SEP), (1, EOS)) == 0.5  # stopped right, the wrong digit
    assert task.reward((BOS, 7, 7, SEP), (7, 7, EOS)) == 0.5  # the digit, stopped late
    assert task.reward((BOS, 7, 7, SEP), (EOS,)) == 0.0  # stopped before the digit
    assert task.reward((BOS, 7, SEP), (7, 7, 7, 7, 7, 7)) == 0.0  # never stopped: cut
    prompts = task.prompts(0, 1, 5, 6)
    assert prompts == task.prompts(0, 1, 5, 6)
    assert prompts != task.prompts(0, 1, 6, 6)
    assert {len(p) for p in prompts} == {3, 4, 5}  # every batch: prompts of three lengths
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2]), 2)
    assert advantages[0] > 0 > advantages[1]
    assert torch.equal(advantages[2:], torch.zeros(4))  # equal rewards teach nothing
    logprobs = torch.zeros(2, 3)
    weights = token_weights(torch.ones(2, 3, dtype=torch.bool), "token-mean", 2)
    loss, metrics = clipped_loss(
        logprobs + 1.0, logprobs, torch.tensor([1.0, -1.0]), weights, clip_low=0.2, clip_high=0.28
    )
    assert metrics["clip_fraction"] == 0.5  # the positive advantage's ratio e is clipped at 1.28
    assert loss.item() == pytest.approx(-(1.28 - math.e) / 2, rel=1e-5)


def test_trainer_and_rollout_logprobs_agree_and_training_raises_the_reward() -> None:
    trainer = TorchRefTrainer(0, 1, SPEC)
    batch = scored_batch(trainer)
    assert {s.weight_version for s in batch} == {0}
    recomputed = trainer.logprobs(batch)
    diff = max(
        abs(a - b)
        for s, r in zip(batch, recomputed, strict=True)
        for a, b in zip(s.logprobs, r, strict=True)
    )
    assert diff < 1e-4
    figures = trainer.train_step(batch)
    assert figures.step == 1 and figures.committed == 1
    assert figures.logprob_max_abs_diff is not None and figures.logprob_max_abs_diff < 1e-4
    assert figures.samples == len(batch) and set(figures.extra) == {"clip_fraction"}
    lengths = figures.lengths
    assert lengths is not None and lengths.samples == len(batch)
    assert lengths.completion_tokens_mean == sum(len(s.tokens) for s in batch) / len(batch)
    assert lengths.completion_tokens_max == max(len(s.tokens) for s in batch)
    truncated = [s.finish_reason == "length" for s in batch]
    assert lengths.truncated_fraction == sum(truncated) / len(batch)
    assert 0.0 < lengths.padding_share < 1.0  # prompts of two lengths at least
    with pytest.raises(OffPolicy, match=r"trains from weight version 1 .* versions \[0\]"):
        trainer.train_step(batch)


def test_offload_and_onload_are_bit_identical() -> None:
    trainer = TorchRefTrainer(0, 1, SPEC)
    trainer.train_step(scored_batch(trainer))  # AdamW state exists now
    params = {n: t.clone() for n, t in trainer.iter_weights()}
    state = {
        (i, k): v.clone()
        for i, s in enumerate(trainer.optimizer.state.values())
        for k, v in s.items()
    }
    trainer.offload()
    trainer.offload_params()
    assert trainer.held_mb() == 0.0
    trainer.onload()
    assert trainer.held_mb() > 0
    for name, tensor in trainer.iter_weights():
        assert torch.equal(tensor, params[name]), name
    restored = {
        (i, k): v for i, s in enumerate(trainer.optimizer.state.values()) for k, v in s.items()
    }
    assert restored.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(restored[key], value), key


def test_every_offload_writes_into_the_host_copies_of_the_first() -> None:
    """The host's copies are allocated once and written in place each step (a fresh copy every
    step fragmented the heap: the trainer's RSS grew), and still hold each step's values."""
    trainer = TorchRefTrainer(0, 1, SPEC)
    addresses: list[set[int]] = []
    for step in range(3):
        trainer.train_step(scored_batch(trainer, step))
        trainer.offload()
        trainer.offload_params()
        host: list[object] = [*trainer.host_params.values()]
        host += [v for s in trainer.host_optimizer.values() for v in s.values()]
        addresses.append({t.data_ptr() for t in host if isinstance(t, torch.Tensor)})
        params = {name: tensor.clone() for name, tensor in trainer.host_params.items()}
        trainer.onload()
        for name, tensor in trainer.iter_weights():  # this step's values, not the first's
            assert torch.equal(tensor, params[name]), name
    assert addresses[0] == addresses[1] == addresses[2]
    assert len(addresses[0]) > len(trainer.host_params)  # parameters and AdamW state


def test_rollout_allocates_on_wake_frees_on_sleep_and_refuses_torn_weights() -> None:
    trainer = TorchRefTrainer(0, 1, SPEC)
    engine = TorchRefRollout(0, SPEC, MODEL)
    requests = TaskWorkload(SPEC.task).requests(0, 0)
    assert engine.held_mb() == 0.0
    with pytest.raises(EngineAsleep):
        engine.wake({"kv_cache"})
    engine.begin_weight_update()
    engine.wake({"weights"})
    weights_mb = engine.held_mb()
    assert weights_mb == pytest.approx(sum(t.nbytes for _, t in trainer.iter_weights()) / 2**20)
    engine.wake({"kv_cache"})
    assert engine.held_mb() > weights_mb
    named = list(trainer.iter_weights())
    engine.load_weights(named[:3])
    with pytest.raises(WeightsTorn):
        engine.generate(requests)  # mid-transfer
    engine.load_weights(named[3:])
    engine.finish_weight_update(0)
    engine.mark_whole(0)  # as its LocalInlet does
    assert engine.digest() == weights_digest(named)
    assert len(engine.generate(requests)) == len(requests)
    engine.sleep()
    assert engine.held_mb() == 0.0
    with pytest.raises(WeightsTorn):
        engine.generate(requests)
    bad = RolloutRequest("img", (BOS, 1, SEP), SamplingParams(max_tokens=2), images=("x",))
    fresh = rollout_with(trainer)
    with pytest.raises(Exception, match="cannot honour images"):
        fresh.generate([bad])


def test_sampling_is_seeded_and_top_p_narrows_it() -> None:
    trainer = TorchRefTrainer(0, 1, SPEC)
    engine = rollout_with(trainer)
    requests = TaskWorkload(SPEC.task).requests(0, 4)
    first = engine.generate(requests)
    assert engine.generate(requests) == first
    narrow = [
        RolloutRequest(r.request_id, r.prompt_tokens, SamplingParams(5, 1.0, 1e-6, seed=1))
        for r in requests
    ]
    greedy = engine.generate(narrow)
    assert len({s.tokens for s in greedy[:4]}) == 1  # one prompt, top-p ~0: one completion


def test_checkpoints_are_atomic_and_committed_only_when_every_rank_has_them(
    tmp_path: Path,
) -> None:
    job = tmp_path / "checkpoints"
    for rank in range(2):
        checkpoint.write(job / f"rank{rank}", 1, {"step": 1})
    checkpoint.write(job / "rank0", 2, {"step": 2})
    assert checkpoint.committed_step(job, 2) == 1  # rank 1 has not written step 2
    (job / "rank1" / ".step-00000002.tmp-999999").mkdir()  # a writer that died mid-write
    assert checkpoint.committed_step(job, 2) == 1
    for step in range(2, 7):
        checkpoint.write(job / "rank1", step, {"step": step})
    # the newest 3 committed steps, and the one a rank may be ahead by
    assert checkpoint.durable_steps(job / "rank1") == {3, 4, 5, 6}
    assert not (job / "rank1" / ".step-00000002.tmp-999999").exists()
    assert checkpoint.read(job / "rank1", 6) == {"step": 6}


def test_keep_checkpoints_never_loses_the_step_a_resume_needs(tmp_path: Path) -> None:
    """[job] keep_checkpoints = 1: rank 0 a step ahead (rank 1 died before writing it) still
    holds the committed step, and the job resumes from it."""
    job = tmp_path / "checkpoints"
    for step in range(1, 6):
        checkpoint.write(job / "rank1", step, {"step": step}, keep=1)
    for step in range(1, 7):
        checkpoint.write(job / "rank0", step, {"step": step}, keep=1)
    assert checkpoint.durable_steps(job / "rank0") == {5, 6}
    assert checkpoint.durable_steps(job / "rank1") == {4, 5}
    assert checkpoint.committed_step(job, 2) == 5


def test_a_trainer_resumes_from_the_committed_step(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints" / "rank0"
    trainer = TorchRefTrainer(0, 1, SPEC)
    assert trainer.bootstrap(directory) == 0
    trainer.train_step(scored_batch(trainer, 0))
    trainer.train_step(scored_batch(trainer, 1))
    digest = weights_digest(trainer.iter_weights())
    again = TorchRefTrainer(0, 1, SPEC)
    assert again.bootstrap(directory) == 2
    assert weights_digest(again.iter_weights()) == digest
    again.onload()
    assert (
        again.optimizer.state_dict()["state"].keys()
        == trainer.optimizer.state_dict()["state"].keys()
    )


def test_train_figures_of_a_checkpoint_written_before_they_were_typed_are_kept() -> None:
    flat = {"step": 3.0, "samples": 8.0, "committed": 3.0, "loss": -0.5, "clip_fraction": 0.25}
    assert figures_kept(flat) == TrainFigures(
        step=3, samples=8, committed=3, loss=-0.5, extra={"clip_fraction": 0.25}
    )
    typed = TrainFigures(step=2, samples=4, reward_mean=0.5, extra={"kl": 0.1})
    assert figures_kept(msgspec.to_builtins(typed)) == typed
    assert figures_kept({"step": "three"}) is None  # unreadable: logged, not fatal
    assert figures_kept(None) is None
