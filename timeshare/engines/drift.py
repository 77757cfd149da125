"""The job's checks (`[checks]`), and the drift probe: every `invariance_every` steps each
rollout re-scores a few of its batch's sequences alone, as it sampled them
(`RolloutEngine.score`), and the step's figures say how far that is from the logprobs the batch
sampled them with: what batch invariance removes (0.0 under `[engine] batch_invariant`,
docs/batch-invariance.md). `on_weights_mismatch` is the cycle's (state/weights.py). Torch-free:
the job config types its section."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated

import msgspec

from timeshare.state.weights import OnMismatch

if TYPE_CHECKING:
    from timeshare.engines.base import RolloutSample  # (base imports torch)

    Scorer = Callable[[list[RolloutSample]], list[tuple[float, ...]]]


class ChecksSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    invariance_every: Annotated[int, msgspec.Meta(ge=0)] = 0  # steps between probes; 0: never
    invariance_samples: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4  # sequences probed
    # A rollout that does not hold its trainer's weights after SYNC: "fail" ends the run naming
    # it (its samples would be off-policy); "warn" goes on, weights_match false, a warning a step.
    on_weights_mismatch: OnMismatch = "fail"

    def probes(self, step: int) -> bool:
        """Whether ROLLOUT `step` is probed (not the bootstrap's, step 0: no step's figures
        carry it)."""
        return self.invariance_every > 0 and step > 0 and step % self.invariance_every == 0


def drift(samples: Sequence[RolloutSample], score: Scorer, count: int) -> float | None:
    """The largest difference between the logprobs of the first `count` of `samples`, each
    re-scored alone by `score`, and those they were sampled with (None: no samples)."""
    probed = list(samples[:count])
    if not probed:
        return None
    alone = [score([sample])[0] for sample in probed]
    return max(
        abs(one - other)
        for sample, rescored in zip(probed, alone, strict=True)
        for one, other in zip(sample.logprobs, rescored, strict=True)
    )
