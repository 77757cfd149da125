"""What every trainer engine promises the cycle, held for each trainer of the registry.

One test per promise; each runs once per trainer (conftest.py), bootstrapped at step 0 from its
own checkpoint directory. What the trainer holds is read from its model and optimiser, never
from its own accounting; what it sends is read back from a rollout engine that loaded it.
"""

from __future__ import annotations

import math

import pytest

from tests.engines.contract.conftest import TRAINERS, kinds
from tests.engines.contract.rollouts import COMPLETION
from tests.engines.contract.trainers import TrainerHarness, same_bytes, uneven_batch
from timeshare.engines import registry
from timeshare.engines.base import TrainerEngine
from timeshare.engines.digest import weights_digest
from timeshare.errors import OffPolicy
from timeshare.protocols.commands.results import TrainFigures

PADDING_ATOL = 1e-5  # fp32: a row's GEMMs and reductions in a batch of another shape
# Completion lengths whose first minibatch (of two) is narrower than the batch
NARROW_FIRST = (2, 1, 3, 2, 4, 3, 1, 4)


def test_the_suite_holds_every_registered_trainer_but_the_simulated_one() -> None:
    # The simulated trainer keeps no checkpoint in its TRAIN and trains on any batch: see
    # conftest.py. It is the weight source of the simulated rollout engine's contract.
    assert kinds(TRAINERS) == set(registry.kinds("trainer")) - {"simulated"}


def test_it_is_built_through_the_registry(trainer_engine: TrainerHarness) -> None:
    engine = trainer_engine.engine
    assert isinstance(engine, TrainerEngine)
    builder = registry.find(trainer_engine.kind, "trainer").trainer
    assert type(engine).__module__ == builder.partition(":")[0]
    assert engine.step == 0 and engine.last_train is None


def test_weights_go_out_under_the_names_rollouts_load_bit_for_bit(
    trainer_engine: TrainerHarness,
) -> None:
    engine = trainer_engine.engine
    initial = trainer_engine.initial_weights()  # read from where the job's model comes from
    outcome, rollout = trainer_engine.sync(engine)
    sent, received = outcome.reports()
    # The rollout loaded every weight by its name (it refuses a name it does not have and a
    # version that leaves one unloaded): the names are the transformers names rollouts load.
    assert sent.version == received.version == rollout.weight_version == 0
    assert sent.tensors == received.tensors == len(initial)
    assert outcome.digest == rollout.digest() == weights_digest(initial.items())
    assert engine.held_mb() == 0.0  # SYNC ends with the parameters offloaded
    # After a step: its new weights, the same way.
    engine.train_step(trainer_engine.batch(engine))
    trained = trainer_engine.parameters(engine)
    outcome, rollout = trainer_engine.sync(engine)
    assert outcome.reports()[1].version == rollout.weight_version == 1
    assert outcome.digest == rollout.digest() == weights_digest(trained.items())
    assert rollout.digest() != weights_digest(initial.items())


def test_offload_and_onload_restore_its_state_bit_for_bit_and_free_what_it_held(
    trainer_engine: TrainerHarness,
) -> None:
    engine = trainer_engine.engine
    engine.train_step(trainer_engine.batch(engine))  # optimiser state exists now
    before = trainer_engine.state(engine)
    assert any(key.startswith("state/") for key in before)
    witness = trainer_engine.witness(engine)
    held = engine.held_mb()
    assert held > 0 and witness.held_mb() == pytest.approx(held)
    engine.offload()  # TRAIN -> OFFLOAD: optimiser state and gradients go
    assert 0 < engine.held_mb() < held
    engine.offload_params()  # after SYNC: the parameters go too
    assert engine.held_mb() == 0.0
    assert witness.held_mb() == 0.0  # what it said it released, it released
    engine.onload()
    after = trainer_engine.state(engine)
    assert after.keys() == before.keys()
    assert [key for key in before if not same_bytes(before[key], after[key])] == []
    assert engine.held_mb() == pytest.approx(trainer_engine.witness(engine).held_mb())
    assert engine.held_mb() == pytest.approx(held)


def test_a_train_step_returns_its_figures_and_refuses_an_off_policy_batch(
    trainer_engine: TrainerHarness,
) -> None:
    engine = trainer_engine.engine
    batch = trainer_engine.batch(engine)
    figures = engine.train_step(batch)
    assert type(figures) is TrainFigures
    assert figures.step == figures.committed == engine.step == 1
    assert figures.samples == len(batch)
    assert figures.loss is not None and math.isfinite(figures.loss)
    assert figures.reward_mean is not None and 0.0 <= figures.reward_mean <= 1.0
    # the batch's logprobs are the trainer's own, as a rollout of its weights reports them
    assert figures.logprob_max_abs_diff is not None and figures.logprob_max_abs_diff < 1e-4
    assert engine.last_train == figures
    digest = weights_digest(trainer_engine.parameters(engine).items())
    with pytest.raises(OffPolicy, match=r"weight version 1 .* versions \[0\]"):
        engine.train_step(batch)  # sampled by version 0's weights; the trainer holds 1's
    assert engine.step == 1
    assert weights_digest(trainer_engine.parameters(engine).items()) == digest


def test_logprobs_of_a_padded_batch_are_those_of_each_row_alone(
    trainer_engine: TrainerHarness,
) -> None:
    """Rows of differing prompt and completion lengths, right-padded into one batch: each
    row's logprobs are those it has alone (no padding reaches a real token), one for each of
    its completion's tokens."""
    engine = trainer_engine.engine
    samples = uneven_batch(engine.step)
    assert len({len(s.prompt_tokens) for s in samples}) == 3
    assert len({len(s.tokens) for s in samples}) == COMPLETION
    engine.onload()
    together = engine.logprobs(samples)
    alone = [engine.logprobs([sample])[0] for sample in samples]
    assert [len(row) for row in together] == [len(s.tokens) for s in samples]
    assert [len(row) for row in alone] == [len(s.tokens) for s in samples]
    rows = zip(together, alone, strict=True)
    differences = [abs(a - b) for x, y in rows for a, b in zip(x, y, strict=True)]
    assert max(differences) <= PADDING_ATOL
    assert all(math.isfinite(v) and v < 0.0 for row in together for v in row)


def test_a_step_trains_minibatches_narrower_than_their_batch(
    trainer_engine: TrainerHarness,
) -> None:
    """The first minibatch's completions are shorter than the batch's longest: it is computed
    trimmed to its own widths, against the batch's old logprobs and weights (padded wider)."""
    engine = trainer_engine.engine
    before = weights_digest(trainer_engine.parameters(engine).items())
    batch = trainer_engine.batch(engine, NARROW_FIRST)
    figures = engine.train_step(batch)
    assert figures.step == 1 and figures.loss is not None and math.isfinite(figures.loss)
    assert figures.logprob_max_abs_diff is not None and figures.logprob_max_abs_diff < 1e-4
    assert figures.lengths is not None and figures.lengths.completion_tokens_max == COMPLETION
    assert weights_digest(trainer_engine.parameters(engine).items()) != before


def test_a_new_trainer_resumes_from_the_committed_step(trainer_engine: TrainerHarness) -> None:
    engine = trainer_engine.engine
    for _ in range(2):
        figures = engine.train_step(trainer_engine.batch(engine))
    engine.onload()
    digest = weights_digest(trainer_engine.parameters(engine).items())
    state = trainer_engine.state(engine)
    again = trainer_engine.another()
    assert again.bootstrap(trainer_engine.checkpoint_dir) == 2
    assert again.step == 2 and again.last_train == figures
    again.onload()
    assert weights_digest(trainer_engine.parameters(again).items()) == digest
    resumed = trainer_engine.state(again)
    assert resumed.keys() == state.keys()
    assert [key for key in state if not same_bytes(state[key], resumed[key])] == []
