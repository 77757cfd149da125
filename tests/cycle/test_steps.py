"""A step's figures from its phase reports: what SYNC moved into each engine, and whether every
tensor-parallel worker of a rollout holds the trainer's weights."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from timeshare.cycle.hooks import PhaseReport
from timeshare.cycle.steps import step_figures
from timeshare.protocols.commands.results import (
    CommandResult,
    LengthFigures,
    RolloutResult,
    SyncResult,
    TrainFigures,
    TrainResult,
    WorkerLoad,
)
from timeshare.protocols.weights import TransferReport
from timeshare.state import Phase

SENT = 3 << 20


def reports(
    rank: int, workers: list[WorkerLoad], digest: str = "d1", receivers: int | None = None
) -> list[PhaseReport]:
    """`rank`'s step; its trainer's session went to `receivers` TP workers (default: one per
    worker that reported, or 1), of which `workers` reported what they loaded."""
    transfer = TransferReport(version=4, bytes=SENT, tensors=9, buckets=3, seconds=0.5)
    results: dict[Phase, tuple[CommandResult, CommandResult]] = {
        Phase.TRAIN: (TrainResult(figures=TrainFigures(step=4, samples=8)), CommandResult()),
        Phase.SYNC: (
            SyncResult(transfer=transfer, digest="d1", receivers=receivers or max(1, len(workers))),
            SyncResult(transfer=transfer, digest=digest, workers=workers),
        ),
        Phase.ROLLOUT: (CommandResult(), RolloutResult(samples=msgspec.Raw(b"[]"))),
    }
    idle = (CommandResult(), CommandResult())
    return [
        PhaseReport(4, rank, phase, 10.0, 0.1, *results.get(phase, idle), answered=10.1)
        for phase in Phase
    ]


def test_a_single_process_engine_shows_the_bytes_sent_and_no_workers() -> None:
    figures = step_figures(4, reports(0, []), [0])
    assert figures.weights_match
    assert (figures.per_rank[0].sent_bytes, figures.per_rank[0].loaded_bytes) == (SENT, [])


def test_every_tp_worker_loaded_the_trainers_weights() -> None:
    workers = [WorkerLoad(0, SENT, "d1"), WorkerLoad(1, SENT, "d1")]
    figures = step_figures(4, reports(0, workers) + reports(1, workers), [0, 1])
    assert figures.weights_match
    assert [rank.loaded_bytes for rank in figures.per_rank] == [[SENT, SENT], [SENT, SENT]]
    assert figures.sync.bytes == 2 * SENT  # each engine's bytes once, not once per worker


@pytest.mark.parametrize("odd_one", [0, 1])
def test_one_tp_worker_with_other_weights_is_no_match(odd_one: int) -> None:
    """The engine's own digest is worker 0's; worker 1's must be checked on its own."""
    workers = [WorkerLoad(k, SENT, "other" if k == odd_one else "d1") for k in range(2)]
    figures = step_figures(4, reports(0, workers), [0])
    assert not figures.weights_match


def test_a_tp_worker_that_sent_no_report_is_no_match() -> None:
    """The trainer's session went to 2 TP workers; only worker 0 said what it loaded."""
    step = reports(0, [WorkerLoad(0, SENT, "d1")], receivers=2)
    assert not step_figures(4, step, [0]).weights_match
    assert step_figures(4, reports(0, [WorkerLoad(0, SENT, "d1")], receivers=1), [0]).weights_match


def served(rank: int, leader: int, digest: str = "d1") -> list[PhaseReport]:
    """A rank of a tensor-parallel group whose engine runs at `leader`: its trainer produced the
    weights (digest) and sent nothing, its rollout worker has no engine."""
    produced = TransferReport(version=4, bytes=SENT, tensors=9, buckets=0, seconds=0.5)
    nothing = TransferReport(version=4, bytes=0, tensors=0, buckets=0, seconds=0.0)
    sync = (
        SyncResult(transfer=produced, digest=digest, receivers=0, served_by=leader),
        SyncResult(transfer=nothing, served_by=leader),
    )
    synced = PhaseReport(4, rank, Phase.SYNC, 10.0, 0.1, *sync, answered=10.1)
    return [synced if r.phase is Phase.SYNC else r for r in reports(rank, [])]


def test_a_rank_served_by_its_groups_engine_holds_what_that_engine_holds() -> None:
    workers = [WorkerLoad(0, SENT, "d1"), WorkerLoad(1, SENT, "d1")]
    figures = step_figures(4, reports(0, workers) + served(1, leader=0), [0, 1])
    assert figures.weights_match and figures.ranks_agree
    assert figures.sync.bytes == SENT  # one engine, sent to once
    assert [rank.sent_bytes for rank in figures.per_rank] == [SENT, 0]
    # The follower's trainer produced other weights than the leader's, which the engine holds.
    assert not step_figures(4, reports(0, workers) + served(1, 0, "d2"), [0, 1]).weights_match
    # The group's engine holds other weights than the follower's trainer produced.
    odd = [WorkerLoad(0, SENT, "d1"), WorkerLoad(1, SENT, "x")]
    assert not step_figures(4, reports(0, odd) + served(1, leader=0), [0, 1]).weights_match


def test_the_completions_figures_combine_every_ranks_weighted_by_samples() -> None:
    def lengths(
        mean: float, longest: int, truncated: float, padding: float, samples: int
    ) -> LengthFigures:
        return LengthFigures(
            completion_tokens_mean=mean,
            completion_tokens_max=longest,
            truncated_fraction=truncated,
            padding_share=padding,
            samples=samples,
        )

    step = []
    for rank, part in enumerate([lengths(2.0, 4, 0.0, 0.2, 8), lengths(5.0, 6, 1.0, 0.6, 24)]):
        train = TrainResult(figures=TrainFigures(step=4, samples=part.samples, lengths=part))
        for report in reports(rank, []):
            step.append(
                dataclasses.replace(report, trainer=train)
                if report.phase is Phase.TRAIN
                else report
            )
    combined = step_figures(4, step, [0, 1]).lengths
    assert combined is not None
    assert combined.completion_tokens_mean == (2.0 * 8 + 5.0 * 24) / 32
    assert combined.completion_tokens_max == 6
    assert combined.truncated_fraction == 0.75
    assert combined.padding_share == pytest.approx((0.2 * 8 + 0.6 * 24) / 32)
    assert combined.samples == 32
    assert (
        step_figures(4, [r for rank in (0, 1) for r in reports(rank, [])], [0, 1]).lengths is None
    )
