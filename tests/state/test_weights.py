"""The weights check, case by case: which rollout does not hold its trainer's weights (the
first, named with its TP worker), and what `[checks] on_weights_mismatch` makes of it."""

from __future__ import annotations

import pytest

from timeshare.state.weights import (
    Judged,
    Mismatch,
    OnMismatch,
    RankSync,
    Verdict,
    first_mismatch,
    judge_weights,
    tensor_difference,
)

D = "xxh3-128:trainer"
X = "xxh3-128:other"


def one_process(rank: int, held: str = D, sent: str = D) -> RankSync:
    """A rank whose engine loads in one process: no TP workers reported."""
    return RankSync(rank=rank, sent=sent, receivers=1, held=held)


def tp(rank: int, *workers: tuple[int, str], receivers: int = 2, held: str = D) -> RankSync:
    """A rank whose engine has `receivers` TP workers, of which `workers` reported."""
    return RankSync(rank=rank, sent=D, receivers=receivers, held=held, workers=workers)


def served(rank: int, leader: int, sent: str = D) -> RankSync:
    """A rank whose rollout `leader`'s engine serves: its trainer sent nothing."""
    return RankSync(rank=rank, sent=sent, receivers=0, held="", served_by=leader)


# (case, the ranks' SYNC reports) -> (rank, TP worker, found) of the first mismatch, or None
CASES: list[tuple[str, list[RankSync], tuple[int, int | None, str | None] | None]] = [
    ("one-process engines, all hold", [one_process(0), one_process(1)], None),
    ("a one-process engine holds other weights", [one_process(0), one_process(1, X)], (1, None, X)),
    ("every TP worker holds", [tp(0, (0, D), (1, D))], None),
    ("TP worker 1 holds other weights", [tp(0, (0, D), (1, X))], (0, 1, X)),
    # The engine's own digest is worker 0's: the worker is named, not the engine.
    ("TP worker 0 holds other weights", [tp(0, (0, X), (1, D), held=X)], (0, 0, X)),
    ("TP worker 1 sent no report", [tp(0, (0, D))], (0, 1, None)),
    ("no TP worker reported", [tp(0)], (0, 0, None)),
    ("a worker the engine does not have", [tp(0, (0, D), (1, D), (2, D))], (0, 2, D)),
    ("a worker reported twice", [tp(0, (0, D), (0, D), (1, D))], (0, 0, D)),
    ("TP size 1 reporting its worker", [tp(0, (0, D), receivers=1)], None),
    ("workers hold, the engine's digest differs", [tp(0, (0, D), (1, D), held=X)], (0, None, X)),
    ("a served rank holds its engine's", [tp(0, (0, D), (1, D)), served(1, 0)], None),
    ("a served rank's trainer sent others", [tp(0, (0, D), (1, D)), served(1, 0, X)], (1, 0, D)),
    ("a served rank's engine lacks a worker", [tp(0, (0, D)), served(1, 0)], (0, 1, None)),
    ("a served rank's engine never reported", [served(1, 0)], (1, None, None)),
    ("the first rank in order is named", [one_process(1, X), one_process(0, X)], (0, None, X)),
]


@pytest.mark.parametrize(("syncs", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_first_rollout_not_holding_its_trainers_weights_is_named(
    syncs: list[RankSync], expected: tuple[int, int | None, str | None] | None
) -> None:
    mismatch = first_mismatch(syncs)
    if expected is None:
        assert mismatch is None
        return
    assert mismatch is not None
    assert (mismatch.rank, mismatch.worker, mismatch.found) == expected
    assert "which tensor differs is not known" in str(mismatch)


def test_the_words_name_the_rank_the_tp_worker_and_both_digests() -> None:
    mismatch = first_mismatch([one_process(0), tp(1, (0, D), (1, X))])
    assert mismatch is not None
    assert str(mismatch).startswith(
        f"rollout rank 1: TP worker 1 of 2 holds {X}, not the {D} its trainer sent"
    )
    missing = first_mismatch([tp(0, (0, D))])
    assert missing is not None
    assert "rollout rank 0: TP worker 1 of 2 sent no report of what it loaded" in str(missing)
    assert "reports came from workers [0]" in str(missing)


@pytest.mark.parametrize(
    ("on_mismatch", "verdict"), [("fail", Verdict.FAIL), ("warn", Verdict.WARN)]
)
def test_a_mismatch_fails_or_warns_as_the_checks_say_and_a_match_holds_either_way(
    on_mismatch: OnMismatch, verdict: Verdict
) -> None:
    assert judge_weights([tp(0, (0, D), (1, D))], on_mismatch) == Judged(Verdict.HOLDS)
    judged = judge_weights([tp(0, (0, D))], on_mismatch)
    assert judged.verdict is verdict
    assert isinstance(judged.mismatch, Mismatch)
    assert (judged.mismatch.rank, judged.mismatch.worker) == (0, 1)


# The trainer's lines of a version, and the ways a rollout's can differ from them.
LINES = {
    "a.weight": "torch.float32|(4, 4)|h1",
    "b.weight": "torch.float32|(4,)|h2",
    "c.weight": "torch.bfloat16|(2, 4)|h3",
}


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        (LINES, None),
        (
            {**LINES, "b.weight": "torch.float32|(4,)|x"},
            "b.weight (torch.float32, shape (4,)): its bytes differ",
        ),
        (
            {**LINES, "c.weight": "torch.float16|(2, 4)|h3"},
            "c.weight was sent as torch.bfloat16 and is held as torch.float16",
        ),
        (
            {**LINES, "a.weight": "torch.float32|(2, 8)|h1"},
            "a.weight was sent with shape (4, 4) and is held with shape (2, 8)",
        ),
        (
            {k: v for k, v in LINES.items() if k != "a.weight"},
            "a.weight was sent and the rollout never loaded it",
        ),
        (
            {**LINES, "a.extra": "torch.float32|(1,)|h4"},
            "a.extra was loaded by the rollout and the trainer never sent it",
        ),
        (  # the first in name order is named, and how many others differ
            {**LINES, "c.weight": "torch.bfloat16|(2, 4)|x", "b.weight": "torch.float32|(4,)|x"},
            "b.weight (torch.float32, shape (4,)): its bytes differ (1 more of 3 differ)",
        ),
    ],
    ids=["same", "bytes", "dtype", "shape", "never-loaded", "never-sent", "first-of-two"],
)
def test_the_first_differing_tensor_is_named_with_how_it_differs(
    held: dict[str, str], expected: str | None
) -> None:
    assert tensor_difference(LINES, held) == expected


def test_a_mismatch_names_its_tensor_or_says_why_it_cannot() -> None:
    mismatch = first_mismatch([one_process(0, X)])
    assert mismatch is not None
    named = mismatch.named(LINES, {**LINES, "c.weight": "torch.bfloat16|(2, 4)|x"})
    assert str(named).endswith(
        "; the first tensor that differs: c.weight (torch.bfloat16, shape (2, 4)): its bytes differ"
    )
    agreeing = mismatch.named(LINES, LINES)
    assert agreeing.tensor is None
    assert "both sides' per-tensor lines agree" in str(agreeing)
    assert str(mismatch.not_named("no answer")).endswith(
        "; which tensor differs is not known: no answer"
    )
