"""What every engine adapter implements, and the request type every rollout engine receives.

`TrainerEngine` and `RolloutEngine` are the two sides a worker process drives. A
`RolloutRequest` carries prompt tokens, sampling parameters and multimodal inputs (images, video,
and the processor's own output); every adapter receives every field, and one that cannot honour a
field raises `UnsupportedInput` instead of dropping it (`refuse_unsupported`). Every sample
carries the weight version that produced it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from timeshare.engines.inlet import WeightInlet
from timeshare.errors import (
    GenerateTimeout,
    PromptTooLong,
    TimeshareError,
    UnsupportedInput,
    WeightsTorn,
)
from timeshare.protocols.commands.results import TrainFigures, WorkerLoad
from timeshare.protocols.weights import TransferConfig
from timeshare.protocols.weights.layout import Weight


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. `max_tokens` bounds it; it ends earlier at the first of
    `stop_token_ids` it samples (kept in the completion, with its logprob). Every engine gets
    the job's one stop set (the tokenizer's EOS, generation_config's, the job's own): none
    adds stop tokens of its own, so that every engine stops where every other would."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = True
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to sample from; the same type serves teacher and reference-logprob calls."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    images: tuple[object, ...] = ()  # passed to the engine as given (paths, bytes, images)
    videos: tuple[object, ...] = ()
    processor_output: Mapping[str, object] | None = None

    def fields_in_use(self) -> set[str]:
        """The optional fields this request sets (what an adapter must honour or refuse)."""
        used = {name for name in ("images", "videos") if getattr(self, name)}
        if self.processor_output is not None:
            used.add("processor_output")
        return used


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class RolloutSample:
    """One completion: its tokens and their logprobs, and the weight version that sampled it.
    `finish_reason`: "stop" when it ended at a stop token (its last token, kept), "length" when
    it reached `max_tokens` without one."""

    request_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int
    prompt_tokens: tuple[int, ...] = ()
    reward: float | None = None  # set by the task once the completion is scored (None: skipped)
    finish_reason: FinishReason = "length"
    # the reward function's further numbers beside its score (averaged into the step's figures)
    reward_extras: dict[str, float] = field(default_factory=dict)


def finish_reason(tokens: tuple[int, ...], stop_token_ids: tuple[int, ...]) -> FinishReason:
    """How a completion of `tokens` ended, by its last token (an engine that says so itself
    is checked against this: contract suite)."""
    return "stop" if tokens and tokens[-1] in stop_token_ids else "length"


def checked_finish_reason(
    engine: str, request: RolloutRequest, tokens: tuple[int, ...], said: object
) -> FinishReason:
    """How `engine` said a completion of `tokens` ended (`said`), checked against its tokens:
    "stop" exactly when its last token is one of the request's stop tokens (kept), else
    "length". A stop at any other token (an engine adding a stop token of its own) or an
    abort is refused, naming the request."""
    expected = finish_reason(tokens, request.sampling.stop_token_ids)
    if said != expected:
        raise TimeshareError(
            f"{engine}: request {request.request_id!r} finished with {said!r} after "
            f"{len(tokens)} tokens ending {list(tokens[-1:])}, but its stop tokens "
            f"{list(request.sampling.stop_token_ids)} and max_tokens "
            f"{request.sampling.max_tokens} make that {expected!r}"
        )
    return expected


def until_stop(tokens: list[int], stop_token_ids: tuple[int, ...]) -> int:
    """How many of `tokens` a completion keeps: up to and including its first stop token."""
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            return index + 1
    return len(tokens)


@dataclass(frozen=True)
class RolloutTraits:
    """What a rollout engine can do here, declared, so that the contract suite
    (tests/engines/contract/) holds it to what it says instead of skipping, and `generate`
    refuses what it cannot honour (`refuse_unsupported`). (The driver's memory rules read
    `held_mb` and `resident_mb`, which follow `releases_memory`.)

    `inputs`: the optional request fields it honours (images, videos, processor_output);
    any other is refused. `releases_memory`: sleep frees what `held_mb` counts; False where the
    platform cannot (then `held_mb` is 0 and `resident_mb` shows what stays). `max_tokens`:
    the longest prompt plus completion it holds (None: no limit); a longer one is refused.
    """

    inputs: frozenset[str] = frozenset()
    releases_memory: bool = True
    max_tokens: int | None = None


def refuse_unsupported(request: RolloutRequest, traits: RolloutTraits, engine: str) -> None:
    """Raise `UnsupportedInput` naming every field of `request` that `engine` cannot honour, or
    `PromptTooLong` if its prompt and completion do not fit."""
    unsupported = sorted(request.fields_in_use() - traits.inputs)
    if unsupported:
        raise UnsupportedInput(
            f"{engine} cannot honour {', '.join(unsupported)} of request {request.request_id!r}"
        )
    tokens = len(request.prompt_tokens) + request.sampling.max_tokens
    if traits.max_tokens is not None and tokens > traits.max_tokens:
        raise PromptTooLong(
            f"{engine}: request {request.request_id!r} needs {tokens} tokens "
            f"({len(request.prompt_tokens)} of prompt, {request.sampling.max_tokens} to "
            f"generate), more than the {traits.max_tokens} it holds"
        )


# A generate's deadline where neither the engine's settings nor its builder give one.
DEFAULT_GENERATE_S = 60.0


def no_progress() -> None:
    """What an engine reports progress to when nothing listens."""


class TrainerEngine(ABC):
    """The trainer side of one rank. `step` is the weight version its parameters hold.

    Long work calls `progress()` now and then: the worker sets it to its heartbeat, and a
    worker that stops calling it is stalled.
    """

    step: int = 0
    progress: Callable[[], None] = staticmethod(no_progress)
    # The figures of the TRAIN that made `step`, kept in its checkpoint (None: not known), so
    # that a run resumed after a crash mid-step can still report that step whole.
    last_train: TrainFigures | None = None

    def bootstrap(self, directory: Path) -> int:
        """Load the last committed checkpoint with the parameters ready to send; return its step."""
        self.load_checkpoint(directory)
        return self.step

    @abstractmethod
    def train_step(self, batch: list[RolloutSample]) -> TrainFigures:
        """One optimisation step on the last rollout batch; returns what it did."""

    @abstractmethod
    def offload(self) -> None:
        """Release optimiser state and gradients from the device (state kept bit for bit)."""

    @abstractmethod
    def onload(self) -> None:
        """Bring back what `offload` released, exactly as it was."""

    @abstractmethod
    def iter_weights(self) -> Iterator[tuple[str, Weight]]:
        """The weights the rollout engine needs, by name (every rank iterates: collectives).
        A weight is a tensor, or a `LentTensor` that writes itself into the channel's staging
        (a gather whose output is staging: the only copy)."""

    @abstractmethod
    def offload_params(self) -> None:
        """After the weights went out: release the parameters from the device too."""

    @abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Model, optimiser, data position and RNG, written atomically."""

    @abstractmethod
    def load_checkpoint(self, directory: Path) -> None: ...

    @abstractmethod
    def logprobs(self, batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        """The trainer's logprobs of the sampled tokens (to compare with the rollout's)."""

    @abstractmethod
    def held_mb(self) -> float:
        """Device memory the trainer still holds (must be 0 once the rollout may wake)."""

    def prepare_sync(self) -> None:  # noqa: B027 - an optional hook
        """Before the weights go out (e.g. reserve staging)."""

    def finish_sync(self) -> None:  # noqa: B027 - an optional hook
        """After the weights went out, before `offload_params`."""

    def close(self) -> None:  # noqa: B027 - an optional hook
        """The worker is shutting down (e.g. leave a process group)."""


class RolloutEngine(ABC):
    """The rollout side of one rank (one shard of an engine that may span several devices)."""

    def __init__(self, generate_timeout_s: float = DEFAULT_GENERATE_S) -> None:
        self.progress: Callable[[], None] = no_progress
        self.weight_version: int | None = None
        self.torn = True  # no whole weight version loaded yet
        # What each tensor-parallel worker of the engine loaded of the last version (empty:
        # an engine that loads in one process).
        self.worker_loads: list[WorkerLoad] = []
        # ... and the per-tensor lines each of those workers' digest is of, by TP rank.
        self.worker_tables: dict[int, dict[str, str]] = {}
        # A generate still running after this is aborted (GenerateTimeout) and the engine stays
        # usable; the driver's phase deadline, around it, is longer.
        self.generate_timeout_s = generate_timeout_s

    @abstractmethod
    def sleep(self) -> None:
        """Release KV cache and weights so the trainer can use the memory."""

    @abstractmethod
    def wake(self, tags: set[str]) -> None:
        """Allocate `weights` and/or `kv_cache` again (checking real free memory first)."""

    @abstractmethod
    def traits(self) -> RolloutTraits:
        """What this engine can do on this platform (see `RolloutTraits`)."""

    @abstractmethod
    def generate(self, requests: list[RolloutRequest]) -> list[RolloutSample]:
        """Sample every request; raises `WeightsTorn` while no whole version is loaded, and
        refuses a request it cannot honour whole (`refuse_unsupported`) before sampling any."""

    def score(self, samples: list[RolloutSample], temperature: float) -> list[tuple[float, ...]]:
        """The logprobs of each sample's completion under the loaded weights, computed as
        `generate` computes them (the drift probe re-scores a sequence alone with it). An
        engine that can says so in its registry entry (`rescores`)."""
        raise TimeshareError(f"{type(self).__name__} cannot re-score samples")

    @abstractmethod
    def digest(self) -> str:
        """`weights_digest` of the weights loaded (compared with the trainer's after SYNC)."""

    def table(self) -> dict[str, str]:
        """The per-tensor lines `digest` is of (engines/digest.py `WeightsDigest.table`):
        asked for only once the digest differs from the trainer's, to name the tensor."""
        raise TimeshareError(f"{type(self).__name__} keeps no per-tensor lines of its weights")

    @abstractmethod
    def held_mb(self) -> float:
        """Device memory this engine holds now, in MiB (0 once it sleeps)."""

    @abstractmethod
    def open_inlet(self, endpoint: str, transfer: TransferConfig) -> WeightInlet:
        """Where this engine's weights come in: a `LocalInlet` loading into the engine in this
        process (a `WeightLoader`), or an inlet that drives the engine's own processes."""

    def resident_mb(self) -> float:
        """Memory this engine keeps even asleep, because the platform cannot release it (MiB).

        Not counted in `held_mb`: the driver's memory rules check only what an engine can
        release; status, the log and the summary show this plainly.
        """
        return 0.0

    def begin_weight_update(self) -> None:
        """A transfer starts: until it finishes, the weights are torn."""
        self.torn = True

    def mark_whole(self, version: int) -> None:
        """A transfer of `version` completed and was post-processed: generate may use it."""
        self.weight_version = version
        self.torn = False

    def close(self) -> None:  # noqa: B027 - an optional hook
        """The worker is shutting down (e.g. stop the engine's own processes)."""

    def generate_deadline(self) -> float:
        """When a generate starting now must have ended (`time.monotonic()`)."""
        return time.monotonic() + self.generate_timeout_s

    def check_deadline(self, deadline: float, requests: int) -> None:
        """`GenerateTimeout` once `deadline` has passed (the caller aborts what still runs)."""
        if time.monotonic() > deadline:
            raise GenerateTimeout(
                f"{type(self).__name__}: generate of {requests} requests still running after "
                f"{self.generate_timeout_s:g} s (aborted)"
            )

    def check_whole(self) -> int:
        if self.torn or self.weight_version is None:
            raise WeightsTorn(
                "weights are torn: no whole transfer completed since the last one began"
            )
        return self.weight_version
