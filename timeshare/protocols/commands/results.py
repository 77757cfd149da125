"""What each worker command returns: one msgspec Struct per (command, role), decoded by the lane.

A worker answers every phase command, also those it has nothing to do in; every answer says how
long its engine worked (`engine_s`; the rest of a phase is orchestration). The driver asks
`WorkerLanes.call(..., returns=result_type(command, role))` and gets the typed result or a
`BadResult` naming the worker: nothing is read by string keys.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from timeshare.protocols.weights.config import TransferReport
from timeshare.timing import Span

Role = Literal["trainer", "rollout"]
ROLES: tuple[Role, Role] = ("trainer", "rollout")


class CommandResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker answers to one command (a phase, bootstrap, held): the time its engine
    worked and the spans it recorded (the whole command first, named after it; then what
    happened inside); each subclass adds what its command reports. Not to be confused with the
    driver's `PhaseReport` (cycle/hooks.py: one rank's phase, both workers' results, as a front
    end is told) and `PhaseRecord` (cycle/records.py: that phase as the timeline logs it)."""

    engine_s: float = 0.0
    spans: tuple[Span, ...] = ()


class LengthFigures(msgspec.Struct, frozen=True, kw_only=True):
    """The completions one TRAIN learned from: their length in tokens (mean, max), the part
    that reached `max_completion_tokens` without a stop token (truncated), and the part of the
    tokens TRAIN's forward laid out that were padding (sequences.py's layout)."""

    completion_tokens_mean: float
    completion_tokens_max: int
    truncated_fraction: float
    padding_share: float
    samples: int = 0  # how many completions (to combine ranks)

    @classmethod
    def combined(cls, parts: list[LengthFigures]) -> LengthFigures | None:
        """Several ranks' figures as one (means weighted by their samples)."""
        if not parts:
            return None
        total = sum(p.samples for p in parts)

        def mean(values: list[float]) -> float:
            if total == 0:
                return sum(values) / len(values)
            return sum(v * p.samples for v, p in zip(values, parts, strict=True)) / total

        return cls(
            completion_tokens_mean=mean([p.completion_tokens_mean for p in parts]),
            completion_tokens_max=max(p.completion_tokens_max for p in parts),
            truncated_fraction=mean([p.truncated_fraction for p in parts]),
            padding_share=mean([p.padding_share for p in parts]),
            samples=total,
        )


class RewardFigures(msgspec.Struct, frozen=True, kw_only=True):
    """How one TRAIN's samples were scored: the part whose reward was skipped (the function
    returned None, or failed under `on_error = "skip"`: they left the loss), and the mean of
    each further number the reward function returned beside `score`, over the samples that
    gave it."""

    skipped_fraction: float = 0.0
    extras: dict[str, float] = {}
    samples: int = 0  # how many samples (to combine ranks)

    @classmethod
    def combined(cls, parts: list[RewardFigures]) -> RewardFigures | None:
        """Several ranks' figures as one (means weighted by their samples)."""
        if not parts:
            return None
        counted = any(p.samples for p in parts)
        weights = [float(p.samples) if counted else 1.0 for p in parts]

        def mean(pairs: list[tuple[float, float]]) -> float:
            return sum(v * w for v, w in pairs) / max(sum(w for _, w in pairs), 1e-12)

        names = sorted({name for p in parts for name in p.extras})
        return cls(
            skipped_fraction=mean(
                [(p.skipped_fraction, w) for p, w in zip(parts, weights, strict=True)]
            ),
            extras={
                name: mean(
                    [
                        (p.extras[name], w)
                        for p, w in zip(parts, weights, strict=True)
                        if name in p.extras
                    ]
                )
                for name in names
            },
            samples=sum(p.samples for p in parts),
        )


class TrainFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What one optimisation step did, as the trainer engine returns it (and its checkpoint
    keeps it). `committed` is the step made durable before the answer (None: this engine keeps
    no checkpoints); `reward_mean` is the mean reward of the samples trained on;
    `logprob_max_abs_diff` compares the trainer's logprobs with the rollout's (over the
    completions' tokens); `lengths` says how long the completions were (None: not measured);
    `extra` holds the engine's other figures (clip_fraction, kl, grad_norm, ...)."""

    step: int
    samples: int
    committed: int | None = None
    reward_mean: float | None = None
    logprob_max_abs_diff: float | None = None
    loss: float | None = None
    train_s: float = 0.0
    extra: dict[str, float] = {}
    lengths: LengthFigures | None = None
    rewards: RewardFigures | None = None


class TrainResult(CommandResult, frozen=True, kw_only=True):
    """One optimisation step (TRAIN, on the trainer): the engine's figures, as it gave them."""

    figures: TrainFigures


class BootstrapResult(CommandResult, frozen=True, kw_only=True):
    """The trainer loaded the last committed checkpoint, of `step`. `train` is the TRAIN that
    made that step, as its checkpoint kept it (None: step 0, or an engine that keeps none)."""

    step: int
    train: TrainFigures | None = None


class WorkerLoad(msgspec.Struct, frozen=True, array_like=True):
    """What one worker of a tensor-parallel rollout engine loaded of a version: its TP rank,
    the bytes that reached its loader, and their digest (the trainer's, when it holds exactly
    what was sent)."""

    worker: int
    bytes: int
    digest: str


class SyncResult(CommandResult, frozen=True, kw_only=True):
    """One weight transfer, from either side: the channel's report of it (what moved, how
    fast), the weights' digest, (the sender) the session's staging buffer count and how many
    receivers each bucket went to, and (an engine whose TP workers each load the version)
    what each of those workers loaded.

    The transfer's spans travel once, among the command's own (`spans`): `transfer.spans` is
    empty.
    """

    transfer: TransferReport
    digest: str = ""
    staging_buffers: int | None = None
    receivers: int = 1
    workers: list[WorkerLoad] = []
    # A rank whose rollout is served by another rank's engine (a tensor-parallel group's):
    # that rank. Its trainer sent nothing and its rollout received nothing.
    served_by: int | None = None


class HeldResult(CommandResult, frozen=True, kw_only=True):
    """Device memory the worker's engine still holds, in MiB (BARRIER on the trainer, `held`)."""

    held_mb: float
    resident_mb: float = 0.0  # what the engine cannot release on this platform (shown only)


class RolloutResult(CommandResult, frozen=True, kw_only=True):
    """One ROLLOUT: the samples (opaque to the driver, which hands them to the rank's next
    TRAIN as they came), the weight version that produced them, and their mean reward."""

    samples: msgspec.Raw
    version: int | None = None
    reward_mean: float | None = None
    resident_mb: float = 0.0  # memory the engine keeps asleep (no sleep mode on the platform)
    # An engine that serves a tensor-parallel group of ranks: the samples of the group's other
    # ranks, by rank (their own rollout workers answer with `served_by` and no samples).
    batches: dict[int, msgspec.Raw] = {}
    served_by: int | None = None
    # The drift probe's step ([checks] invariance_every): the largest difference between a
    # sequence's logprobs re-scored alone and those it was sampled with in the batch.
    invariance_max_abs_diff: float | None = None
    # A validation step (`[engine.task] val_every`): the mean reward of the validation prompts,
    # generated with the weights of this ROLLOUT and never trained on.
    val_reward_mean: float | None = None
    val_samples: int = 0


class TablesResult(CommandResult, frozen=True, kw_only=True):
    """A side's per-tensor lines of the last version it sent or loaded (name -> "dtype|shape|
    hash of the bytes", engines/digest.py): asked for only once its digest differs from the
    other side's, to name the first tensor that does (`tables`). `tensors`: the trainer's, or
    the rollout engine's own; `workers`: each TP worker's that reported them, by TP rank."""

    version: int
    tensors: dict[str, str] = {}
    workers: dict[int, dict[str, str]] = {}


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's answer to `status` on its control lane (answered while work runs)."""

    role: str
    rank: int
    pid: int
    busy: str | None  # the command on its work lane, if any
    progress: int  # grows while its engine makes progress


RESULTS: dict[tuple[str, str], type[CommandResult]] = {
    ("bootstrap", "trainer"): BootstrapResult,
    ("train", "trainer"): TrainResult,
    ("sync", "trainer"): SyncResult,
    ("sync", "rollout"): SyncResult,
    ("barrier", "trainer"): HeldResult,
    ("rollout", "rollout"): RolloutResult,
    ("held", "trainer"): HeldResult,
    ("held", "rollout"): HeldResult,
    ("tables", "trainer"): TablesResult,
    ("tables", "rollout"): TablesResult,
}
COMMANDS = frozenset(
    {"bootstrap", "train", "offload", "sync", "barrier", "resume", "rollout", "held", "tables"}
)


def result_type(command: str, role: str) -> type[CommandResult]:
    """The type `role`'s answer to `command` has (CommandResult where it has nothing to report)."""
    if command not in COMMANDS:
        raise ValueError(f"no worker command {command!r}; commands are {sorted(COMMANDS)}")
    return RESULTS.get((command, role), CommandResult)
