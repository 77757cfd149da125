"""A simulated engine pair for testing orchestration: real tensors, simulated device memory.

Device memory is a ledger per simulated accelerator, kept in the job store so that the trainer
and rollout processes of every rank see the same one; an allocation that does not fit raises
`SimulatedOOM` naming device, owner and sizes. Sizes come from `SimulatedSpec` (spec.py). The
rollout engine may span several ranks' devices (`engine_span`), as a tensor-parallel engine does:
its leader wakes and sleeps the memory of every device it spans. Weights are real tensors, moved
through the real weight channel; their values follow the step, so a mismatch is visible.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from timeshare.durable import write_atomically
from timeshare.engines.base import (
    DEFAULT_GENERATE_S,
    RolloutEngine,
    RolloutRequest,
    RolloutSample,
    RolloutTraits,
    TrainerEngine,
    refuse_unsupported,
)
from timeshare.engines.context import EngineContext
from timeshare.engines.digest import digest_of
from timeshare.engines.inlet import LocalInlet
from timeshare.engines.simulated.spec import SimulatedSpec
from timeshare.errors import LoaderFailed, SimulatedOOM
from timeshare.protocols.commands.results import TrainFigures
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import TransferConfig

KIB_PER_MB = 1024
PROGRESS_STEP_S = 0.05


class DeviceLedger:
    """Per-device memory accounts in the job store; atomic across processes."""

    def __init__(self, store: JobStore, capacity_mb: float, *, enabled: bool = True) -> None:
        self.store = store
        self.capacity_kib = int(capacity_mb * KIB_PER_MB)
        self.enabled = enabled

    def allocate(self, device: int, owner: str, mb: float) -> None:
        if not self.enabled:
            return
        amount = int(mb * KIB_PER_MB)
        used = self.store.add(f"ledger/{device}/used", amount)
        if used > self.capacity_kib:
            self.store.add(f"ledger/{device}/used", -amount)
            raise SimulatedOOM(
                f"simulated OOM on device {device}: {owner} needs {mb:g} MiB, "
                f"{(used - amount) / KIB_PER_MB:g} of {self.capacity_kib / KIB_PER_MB:g} MiB in use"
            )
        self.store.add(f"ledger/{device}/owner/{owner}", amount)

    def release(self, device: int, owner: str) -> float:
        """Free everything `owner` holds on `device`; return the MiB freed."""
        held = self.held(device, owner)
        if not held:
            return 0.0
        amount = int(held * KIB_PER_MB)
        self.store.add(f"ledger/{device}/owner/{owner}", -amount)
        self.store.add(f"ledger/{device}/used", -amount)
        return held

    def held(self, device: int, owner: str) -> float:
        if not self.enabled:
            return 0.0
        return self.store.add(f"ledger/{device}/owner/{owner}", 0) / KIB_PER_MB

    def used(self, device: int) -> float:
        return self.store.add(f"ledger/{device}/used", 0) / KIB_PER_MB


def weight_names(spec: SimulatedSpec) -> list[str]:
    return [f"layer{i}.weight" for i in range(spec.tensors)]


def weights_of_step(step: int, spec: SimulatedSpec) -> dict[str, torch.Tensor]:
    """The trainer's weights after `step` steps: values that tell the step apart."""
    return {
        name: torch.full((spec.tensor_numel,), step + i / 1000.0)
        for i, name in enumerate(weight_names(spec))
    }


def simulate_work(
    spec: SimulatedSpec,
    phase: str,
    rank: int,
    progress: Callable[[], None],
    check: Callable[[], None] = lambda: None,
) -> None:
    """Take the time `spec.delays` gives `phase` on `rank`, reporting progress as real work does
    (and calling `check` as often: a deadline that raises)."""
    deadline = time.monotonic() + spec.delays.get(phase, {}).get(str(rank), 0.0)
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, PROGRESS_STEP_S))
        progress()
        check()


def ledger_of(context: EngineContext) -> DeviceLedger:
    spec = context.spec.settings("simulated", SimulatedSpec)
    return DeviceLedger(context.store, spec.sizes.device_mb, enabled=spec.account_memory)


def build_trainer(context: EngineContext) -> SimulatedTrainer:
    """The registry's trainer builder (registry.py)."""
    spec = context.spec.settings("simulated", SimulatedSpec)
    return SimulatedTrainer(context.rank, spec, ledger_of(context))


def build_rollout(context: EngineContext) -> SimulatedRollout:
    """The registry's rollout builder (registry.py)."""
    spec = context.spec.settings("simulated", SimulatedSpec)
    rollout = SimulatedRollout(context.rank, spec, ledger_of(context))
    rollout.generate_timeout_s = spec.generate_timeout_s or context.generate_timeout_s
    return rollout


class SimulatedTrainer(TrainerEngine):
    """Rank `rank`'s trainer on device `rank`: parameters, optimiser state, staging."""

    def __init__(self, rank: int, spec: SimulatedSpec, ledger: DeviceLedger) -> None:
        self.rank = rank
        self.spec = spec
        self.ledger = ledger
        self.step = 0
        self.weights = weights_of_step(0, spec)

    def _owner(self, part: str) -> str:
        return f"trainer.{part}"

    def onload(self) -> None:
        sizes = self.spec.sizes
        for part, mb in (("params", sizes.params_mb), ("optimizer", sizes.optimizer_mb)):
            if self.ledger.held(self.rank, self._owner(part)) == 0:
                self.ledger.allocate(self.rank, self._owner(part), mb)

    def train_step(self, batch: list[RolloutSample]) -> TrainFigures:
        self.onload()
        self.delay("train")
        self.step += 1
        self.weights = weights_of_step(self.step, self.spec)
        return TrainFigures(step=self.step, samples=len(batch))

    def offload(self) -> None:
        self.delay("offload")
        self.ledger.release(self.rank, self._owner("optimizer"))

    def bootstrap(self, directory: Path) -> int:
        self.load_checkpoint(directory)
        self.hold_params()
        return self.step

    def prepare_sync(self) -> None:
        self.hold_staging()

    def finish_sync(self) -> None:
        self.free_staging()
        self.delay("sync")

    def hold_params(self) -> None:
        """The parameters are on the device (bootstrap: the checkpoint was just loaded)."""
        if self.ledger.held(self.rank, self._owner("params")) == 0:
            self.ledger.allocate(self.rank, self._owner("params"), self.spec.sizes.params_mb)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    def hold_staging(self) -> None:
        self.ledger.allocate(self.rank, self._owner("staging"), self.spec.sizes.staging_mb)

    def free_staging(self) -> None:
        self.ledger.release(self.rank, self._owner("staging"))

    def offload_params(self) -> None:
        self.ledger.release(self.rank, self._owner("params"))

    def held_mb(self) -> float:
        self.delay("barrier")  # the simulated work of BARRIER is while the release is checked
        return sum(
            self.ledger.held(self.rank, self._owner(p)) for p in ("params", "optimizer", "staging")
        )

    def save_checkpoint(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(directory / "trainer.json", json.dumps({"step": self.step}).encode())

    def load_checkpoint(self, directory: Path) -> None:
        path = directory / "trainer.json"
        self.step = json.loads(path.read_text())["step"] if path.exists() else 0
        self.weights = weights_of_step(self.step, self.spec)

    def logprobs(self, batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        return [sample.logprobs for sample in batch]

    def delay(self, phase: str) -> None:
        simulate_work(self.spec, phase, self.rank, self.progress)


# The simulated rollout ignores the content of these fields, so it can honour them all.
EVERY_INPUT = frozenset({"images", "videos", "processor_output"})


class SimulatedRollout(RolloutEngine):
    """Rank `rank`'s shard of a rollout engine spanning `engine_span` devices."""

    def __init__(self, rank: int, spec: SimulatedSpec, ledger: DeviceLedger) -> None:
        super().__init__(spec.generate_timeout_s or DEFAULT_GENERATE_S)
        self.rank = rank
        self.spec = spec
        self.ledger = ledger
        self.leader = rank - rank % spec.engine_span
        self.devices = range(self.leader, self.leader + spec.engine_span)
        self.loaded: dict[str, torch.Tensor] = {}

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def wake(self, tags: set[str]) -> None:
        if not self.is_leader:
            return  # the leader wakes the memory of every device the engine spans
        sizes = {"weights": self.spec.sizes.weights_mb, "kv_cache": self.spec.sizes.kv_cache_mb}
        for tag in sorted(tags):
            for device in self.devices:
                if self.ledger.held(device, f"rollout.{tag}") == 0:
                    self.ledger.allocate(device, f"rollout.{tag}", sizes[tag])

    def sleep(self) -> None:
        if self.is_leader:
            for device in self.devices:
                for tag in ("kv_cache", "weights"):
                    self.ledger.release(device, f"rollout.{tag}")

    def open_inlet(self, endpoint: str, transfer: TransferConfig) -> LocalInlet:
        return LocalInlet(self, endpoint, transfer)

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Keep a copy of each weight; a name the simulated trainer never sends, or a shape or
        dtype other than its (`weights_of_step`), is refused."""
        known = weight_names(self.spec)
        shape = (self.spec.tensor_numel,)
        for name, tensor in named:
            if name not in known:
                raise LoaderFailed(f"simulated rollout: no weight {name!r} to load")
            if tuple(tensor.shape) != shape or tensor.dtype != torch.float32:
                raise LoaderFailed(
                    f"simulated rollout: {name} is {tuple(tensor.shape)} {tensor.dtype}, the "
                    f"engine takes {shape} {torch.float32}"
                )
            self.loaded[name] = tensor.clone()

    def held_mb(self) -> float:
        if not self.is_leader:
            return 0.0  # the leader holds the memory of every device the engine spans
        tags = ("weights", "kv_cache")
        return sum(self.ledger.held(d, f"rollout.{t}") for d in self.devices for t in tags)

    def finish_weight_update(self, version: int) -> None:
        """Nothing to post-process: the copies are the weights (altered, where the spec's
        `corrupt_weights` drills a rollout holding other weights than the trainer's)."""
        first = self.spec.corrupt_weights.get(str(self.rank))
        if first is not None and version >= first:
            self.loaded[weight_names(self.spec)[-1]][0] += 1.0

    def digest(self) -> str:
        return digest_of(self.loaded.items()).hexdigest()

    def table(self) -> dict[str, str]:
        return digest_of(self.loaded.items()).table()

    def traits(self) -> RolloutTraits:
        """Every input (ignored), memory in the ledger, no sequence limit."""
        return RolloutTraits(inputs=EVERY_INPUT)

    def generate(self, requests: list[RolloutRequest]) -> list[RolloutSample]:
        version = self.check_whole()
        for request in requests:
            refuse_unsupported(request, self.traits(), "simulated rollout")
        deadline = self.generate_deadline()
        check = partial(self.check_deadline, deadline, len(requests))
        simulate_work(self.spec, "rollout", self.rank, self.progress, check)
        samples = []
        for request in requests:
            n = request.sampling.max_tokens
            samples.append(
                RolloutSample(
                    request.request_id,
                    tuple(range(n)),
                    (0.0,) * n,
                    version,
                    prompt_tokens=request.prompt_tokens,
                )
            )
        return samples

    def delay(self, phase: str) -> None:
        simulate_work(self.spec, phase, self.rank, self.progress)
