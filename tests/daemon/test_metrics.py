"""The step's figures the daemon exports to Prometheus: the trainer/rollout logprob difference,
the drift probe's, the completions' lengths, and whether the rollouts held the trainer's weights,
as a scrape reads them (prometheus_client's own text format)."""

from __future__ import annotations

import msgspec
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from timeshare.cycle.steps import PHASES, StepFigures, SyncFigures
from timeshare.daemon.metrics import Metrics
from timeshare.protocols.commands.results import LengthFigures, RewardFigures
from timeshare.report.scalars import scalars_of


def figures(step: int, logprob: float | None, drift: float | None) -> StepFigures:
    return StepFigures(
        step=step,
        weight_version=step,
        sample_version=step - 1,
        reward_mean=None,
        phases={},
        per_rank=[],
        bubble_s=0.0,
        step_s=1.0,
        sync=SyncFigures(0, 0.0, 0.0),
        weights_match=True,
        ranks_agree=True,
        logprob_max_abs_diff=logprob,
        rollout_resident_mb=0.0,
        committed_step=None,
        resumed=False,
        invariance_max_abs_diff=drift,
    )


def scraped(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("timeshare_logprob_max_abs_diff", "timeshare_invariance_max_abs_diff")
    }


def test_each_step_sets_the_logprob_difference_and_a_probed_step_the_drift() -> None:
    metrics = Metrics(node=1)
    metrics.stepped(figures(1, 2.5e-6, 1.2e-6))
    assert scraped(metrics) == {
        "timeshare_logprob_max_abs_diff": 2.5e-6,
        "timeshare_invariance_max_abs_diff": 1.2e-6,
    }
    metrics.stepped(figures(2, 0.0, None))  # not a probed step: the last probe's stays
    assert scraped(metrics) == {
        "timeshare_logprob_max_abs_diff": 0.0,
        "timeshare_invariance_max_abs_diff": 1.2e-6,
    }


def test_each_step_sets_its_completions_lengths_truncation_and_padding() -> None:
    metrics = Metrics(node=1)
    lengths = LengthFigures(
        completion_tokens_mean=3.5,
        completion_tokens_max=6,
        truncated_fraction=0.25,
        padding_share=0.4,
        samples=8,
    )
    metrics.stepped(msgspec.structs.replace(figures(1, 0.0, None), lengths=lengths))
    text = generate_latest(metrics.registry).decode()
    found = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert found["timeshare_completion_tokens_mean"] == 3.5
    assert found["timeshare_truncated_fraction"] == 0.25
    assert found["timeshare_padding_share"] == 0.4


def weights(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("timeshare_weights_match", "timeshare_weights_mismatch_total")
    }


def test_each_step_sets_whether_the_weights_matched_and_counts_the_mismatches() -> None:
    metrics = Metrics(node=1)
    metrics.stepped(figures(1, 0.0, None))
    assert weights(metrics) == {"timeshare_weights_match": 1, "timeshare_weights_mismatch_total": 0}
    other = msgspec.structs.replace(figures(2, 0.0, None), weights_match=False)  # under "warn"
    metrics.stepped(other)
    metrics.stepped(msgspec.structs.replace(other, step=3))
    assert weights(metrics) == {"timeshare_weights_match": 0, "timeshare_weights_mismatch_total": 2}
    metrics.stepped(figures(4, 0.0, None))
    assert weights(metrics) == {"timeshare_weights_match": 1, "timeshare_weights_mismatch_total": 2}


def test_a_run_failed_by_a_weights_mismatch_counts_it() -> None:
    """Under "fail" the step's figures never come: its SYNC ended the run."""
    metrics = Metrics(node=1)
    metrics.stepped(figures(1, 0.0, None))
    metrics.failed("WorkerDied")
    assert weights(metrics) == {"timeshare_weights_match": 1, "timeshare_weights_mismatch_total": 0}
    metrics.failed("WeightsMismatch")
    assert weights(metrics) == {"timeshare_weights_match": 0, "timeshare_weights_mismatch_total": 1}


def test_each_step_sets_its_rewards_the_skipped_share_and_a_validations_reward() -> None:
    metrics = Metrics(node=1)
    rewards = RewardFigures(skipped_fraction=0.125, extras={"acc": 0.5}, samples=8)
    step = msgspec.structs.replace(
        figures(1, 0.0, None), reward_mean=0.75, rewards=rewards, val_reward_mean=0.6
    )
    metrics.stepped(step)
    found = every_sample(metrics)
    assert found["timeshare_reward_mean"] == 0.75
    assert found["timeshare_reward_skipped_fraction"] == 0.125
    assert found["timeshare_val_reward_mean"] == 0.6
    metrics.stepped(msgspec.structs.replace(step, val_reward_mean=None, reward_mean=0.8))
    found = every_sample(metrics)  # not a validation step: the last validation's stays
    assert found["timeshare_val_reward_mean"] == 0.6 and found["timeshare_reward_mean"] == 0.8
    scalars = scalars_of(msgspec.structs.replace(step, phases=dict.fromkeys(PHASES, 0.0)))
    assert scalars["val_reward"] == 0.6
    assert scalars["reward/skipped_fraction"] == 0.125 and scalars["reward/acc"] == 0.5


def test_ranks_reward_figures_combine_weighted_by_their_samples() -> None:
    combined = RewardFigures.combined(
        [
            RewardFigures(skipped_fraction=0.5, extras={"acc": 1.0}, samples=2),
            RewardFigures(skipped_fraction=0.0, extras={"acc": 0.0, "len": 3.0}, samples=6),
        ]
    )
    assert combined == RewardFigures(
        skipped_fraction=0.125, extras={"acc": 0.25, "len": 3.0}, samples=8
    )
    assert RewardFigures.combined([]) is None


def every_sample(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
