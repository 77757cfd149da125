"""The OFFLOAD every sharded trainer (FSDP's, Megatron's) shares: what moves off, when, and that
it comes back bit for bit. A small torch model stands for the sharded one: the moves only see
storages (the FSDP and Megatron trainers' own tests run them on their real models)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

from timeshare.engines.base import RolloutSample
from timeshare.engines.grpo import GrpoBatch
from timeshare.engines.sequences import Sequences
from timeshare.engines.sharded_trainer import ShardedTrainer, pick_device
from timeshare.engines.spec import EngineChoice
from timeshare.errors import ConfigError
from timeshare.protocols.weights.layout import Weight
from timeshare.units import MIB


class LinearTrainer(ShardedTrainer):
    """A trainer of one linear layer (and a frozen reference copy), AdamW, one step taken."""

    def __init__(self, *, reference: bool) -> None:
        super().__init__(0, 1, EngineChoice(), device=torch.device("cpu"))
        torch.manual_seed(0)
        self._model = torch.nn.Linear(64, 32)
        if reference:
            self._reference = torch.nn.Linear(64, 32).requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self._model.parameters())
        self._model(torch.ones(2, 64)).sum().backward()
        self.optimizer.step()  # AdamW's state now exists, and the gradients
        self.saved: list[Path] = []

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        assert self._model is not None
        tensors = [p.grad for p in self._model.parameters() if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def save_checkpoint(self, directory: Path) -> None:
        with self.onloaded():
            assert self.param_store.nbytes == 0  # everything is on the device inside
            self.saved.append(directory)

    def load_checkpoint(self, directory: Path) -> None:
        raise NotImplementedError

    def iter_weights(self) -> Iterator[tuple[str, Weight]]:
        raise NotImplementedError

    def logprobs(self, batch: list[RolloutSample]) -> list[tuple[float, ...]]:
        raise NotImplementedError

    def policy_logprobs(self, sequences: Sequences) -> torch.Tensor:
        raise NotImplementedError

    def reference_logprobs(self, sequences: Sequences) -> torch.Tensor | None:
        raise NotImplementedError

    def update(self, data: GrpoBatch, rows: range) -> tuple[float, dict[str, float]]:
        raise NotImplementedError


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


PARAMS_MB = (64 * 32 + 32) * 4 / MIB  # one linear layer's weight and bias, float32


@pytest.mark.parametrize("reference", [False, True])
def test_offload_moves_optimiser_then_parameters_off_and_onload_brings_them_back_exact(
    reference: bool,
) -> None:
    trainer = LinearTrainer(reference=reference)
    params, optimiser = snapshot(trainer._parameters()), snapshot(trainer._optimizer_tensors())
    models = 2 if reference else 1
    # parameters, gradients, AdamW's two moments (+ its step counters, 4 bytes each)
    assert trainer.held_mb() == pytest.approx(PARAMS_MB * (models + 3), abs=1e-4)

    trainer.offload()
    assert trainer.held_mb() == pytest.approx(PARAMS_MB * models)
    trainer.offload_params()
    assert trainer.held_mb() == 0.0  # the rollout may wake

    trainer.onload()
    assert same(snapshot(trainer._parameters()), params)
    assert same(snapshot(trainer._optimizer_tensors()), optimiser)


def test_a_commit_between_phases_saves_everything_and_leaves_the_parameters_off() -> None:
    trainer = LinearTrainer(reference=False)
    trainer.commit()
    assert trainer.saved == []  # no checkpoint root before a checkpoint was looked for
    trainer.checkpoint_root = Path("/job/checkpoints")
    trainer.offload()
    trainer.offload_params()
    trainer.commit()
    assert trainer.saved == [Path("/job/checkpoints/rank0")]
    assert trainer.param_store.nbytes > 0  # off again, as before the commit


def test_no_committed_step_starts_from_the_model_directory_at_step_0() -> None:
    trainer = LinearTrainer(reference=False)
    trainer.step = 7
    assert trainer.agreed_step(Path("/job/checkpoints/rank0"), None) is None
    assert trainer.step == 0
    assert trainer.checkpoint_root == Path("/job/checkpoints")
    assert trainer.agreed_step(Path("/job/checkpoints/rank0"), 4) == 4


def test_a_cuda_device_this_process_cannot_see_is_a_config_error_naming_the_key() -> None:
    assert pick_device("cpu", "engine.fsdp.device") == torch.device("cpu")
    with (
        mock.patch("torch.cuda.is_available", return_value=False),
        pytest.raises(ConfigError, match=r'engine\.megatron\.device = "cuda"'),
    ):
        pick_device("cuda", "engine.megatron.device")
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert pick_device("auto", "engine.fsdp.device") == torch.device("cpu")


def test_a_checkpoint_that_fails_leaves_the_parameters_off_as_they_were() -> None:
    trainer = LinearTrainer(reference=False)
    trainer.offload()
    trainer.offload_params()
    with pytest.raises(OSError, match="disk full"), trainer.onloaded():
        assert trainer.param_store.nbytes == 0
        raise OSError("disk full")
    assert trainer.param_store.nbytes > 0  # off again: the rollout may still wake
