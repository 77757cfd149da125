"""What the trainers of sharded torch models (FSDP's, Megatron's) do alike: the device they run
on, OFFLOAD and its way back through `host_memory.HostStore`, and committing each step.

A trainer says which tensors are its parameters and which its optimiser's (`_model`,
`_reference`, `_optimizer_tensors`); the moves are this class's. The reference trainer
(torch_ref) keeps its own memory on purpose: its device is the process heap, whose holes it
hands back every step (host_memory.return_free_heap).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog
import torch

from timeshare.engines import step_dirs
from timeshare.engines.grpo import GrpoTrainer
from timeshare.engines.handoff import COLLECTIVE_TIMEOUT_S
from timeshare.engines.host_memory import HostStore, resident_bytes
from timeshare.engines.spec import EngineChoice
from timeshare.errors import ConfigError
from timeshare.protocols.store import JobStore
from timeshare.units import MIB

log = structlog.get_logger(__name__)


def widened(values: torch.Tensor, completion_width: int) -> torch.Tensor:
    """A part's per-token values [rows, its completion width] padded with 0.0 to the batch's
    `completion_width`: a part is computed trimmed to its own widths (`Sequences.select`), the
    batch's tensors (old logprobs, weights) keep the batch's; the weights are 0.0 there."""
    return torch.nn.functional.pad(values, (0, completion_width - values.shape[1]))


def pick_device(name: str, key: str) -> torch.device:
    """The device `name` ("auto", "cpu", "cuda") means in this process; `key` names the setting
    for an error (`engine.fsdp.device`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f'{key} = "cuda" but this process sees no CUDA device')
    return torch.device(name)


class ShardedTrainer(GrpoTrainer):
    """A GRPO trainer whose model, reference model and optimiser move off the device between
    phases, bit for bit, and back before they are used."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: EngineChoice,
        *,
        device: torch.device,
        store: JobStore | None = None,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.task = engine.task
        self.grpo = engine.grpo
        self.store = store
        self.collective_timeout_s = collective_timeout_s
        self.device = device
        self.step = 0
        self.checkpoint_root: Path | None = None
        self.optimizer_store = HostStore()  # optimiser state and gradients while offloaded
        self.param_store = HostStore()  # parameter shards while offloaded
        # Built once the process group is joined (each trainer's `build`):
        self._model: torch.nn.Module | None = None
        self._reference: torch.nn.Module | None = None  # a KL term's frozen model

    @abstractmethod
    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The gradients and optimiser state this rank holds (moved off by `offload`)."""

    # -- memory --------------------------------------------------------------------------------

    def offload(self) -> None:
        """Optimiser state and gradients to the host; their device storage freed."""
        moved = self.optimizer_store.move_off(self._optimizer_tensors())
        log.info("trainer.offload", rank=self.rank, freed_mb=round(moved / MIB, 3))

    def offload_params(self) -> None:
        """The parameter shards (the reference model's too) to the host, after SYNC."""
        moved = self.param_store.move_off(self._parameters())
        log.info("trainer.offload_params", rank=self.rank, freed_mb=round(moved / MIB, 3))

    def onload(self) -> None:
        self.param_store.bring_back()
        self.optimizer_store.bring_back()

    def held_mb(self) -> float:
        """Device bytes of parameter shards, gradients and optimiser state held now."""
        held = resident_bytes(self._parameters()) + resident_bytes(self._optimizer_tensors())
        return held / MIB

    def _parameters(self) -> list[torch.Tensor]:
        """The trained model's parameter shards, and the reference model's (a KL term)."""
        assert self._model is not None, "bootstrap first"
        parameters: list[torch.Tensor] = list(self._model.parameters())
        if self._reference is not None:
            parameters += self._reference.parameters()
        return parameters

    @contextmanager
    def onloaded(self) -> Iterator[None]:
        """Everything on the device inside (a checkpoint reads it all); the parameters go back
        off after (whatever happened inside) if they were off before."""
        params_offloaded = bool(self.param_store.moved)
        self.onload()
        try:
            yield
        finally:
            if params_offloaded:
                self.offload_params()

    # -- checkpoints ---------------------------------------------------------------------------

    def agreed_step(self, directory: Path, committed: int | None) -> int | None:
        """The newest step every rank holds durably (`committed` is this rank's newest), None
        for none: then the model directory's weights, at step 0. Keeps the job's checkpoint
        root (`directory`'s parent) for the commits to come."""
        self.checkpoint_root = directory.parent
        step = step_dirs.agreed(committed, self.world_size, self.device, self.checkpoint_root)
        if step is None:
            self.step = 0
        return step

    def commit(self) -> None:
        if self.checkpoint_root is not None:
            self.save_checkpoint(self.checkpoint_root / f"rank{self.rank}")
