"""TensorBoard scalars of a run, one point per step: what `[log].tensorboard = DIR` writes.

`scalars_of` says which figures of a step become which scalar (pure); `ScalarWriter` writes them
with TensorBoard's own event-file writer (torch's SummaryWriter over the `tensorboard`
package), which flushes in its own thread: adding a step never waits for the disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from timeshare.cycle.steps import PHASES, StepFigures

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

FLUSH_S = 2


def scalars_of(figures: StepFigures) -> dict[str, float]:
    """Every scalar of one step, by its TensorBoard tag (a figure a step lacks is left out)."""
    scalars = {f"phase_s/{phase}": figures.phases[phase] for phase in PHASES}
    scalars |= {
        "step_s": figures.step_s,
        "bubble_s": figures.bubble_s,
        "sync/bytes": float(figures.sync.bytes),
        "sync/gbps": figures.sync.gbps,
        "weights_match": float(figures.weights_match),
        "memory/held_at_barrier_mb": figures.held_at_barrier_mb,
    }
    if figures.reward_mean is not None:
        scalars["reward"] = figures.reward_mean
    if figures.val_reward_mean is not None:
        scalars["val_reward"] = figures.val_reward_mean
    if (rewards := figures.rewards) is not None:
        scalars["reward/skipped_fraction"] = rewards.skipped_fraction
        scalars |= {f"reward/{name}": value for name, value in rewards.extras.items()}
    if figures.logprob_max_abs_diff is not None:
        scalars["logprob_max_abs_diff"] = figures.logprob_max_abs_diff
    if figures.invariance_max_abs_diff is not None:
        scalars["invariance_max_abs_diff"] = figures.invariance_max_abs_diff
    if (lengths := figures.lengths) is not None:
        scalars |= {
            "completion/tokens_mean": lengths.completion_tokens_mean,
            "completion/tokens_max": float(lengths.completion_tokens_max),
            "completion/truncated_fraction": lengths.truncated_fraction,
            "train/padding_share": lengths.padding_share,
        }
    return scalars


class ScalarWriter:
    """Event files in `directory`, one point per step and tag."""

    def __init__(self, directory: Path) -> None:
        # Imported here: torch's writer needs the `tensorboard` package (the `report` extra),
        # which only a run that asks for scalars needs.
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

        directory.mkdir(parents=True, exist_ok=True)
        self._writer: SummaryWriter = SummaryWriter(str(directory), flush_secs=FLUSH_S)

    def add(self, figures: StepFigures) -> None:
        for tag, value in scalars_of(figures).items():
            self._writer.add_scalar(tag, value, global_step=figures.step)

    def close(self) -> None:
        """Everything written and the file closed (blocks: call it off the event loop)."""
        self._writer.close()
