"""On CUDA, the Megatron trainer runs megatron's own DistributedDataParallel and distributed
optimizer: it trains, sends the weights SYNC sends, frees the device memory of its gradient
buffers, master weights and Adam state at OFFLOAD and brings them back bit for bit, and resumes
from its checkpoint (one rank, NCCL; run where a GPU is: `pytest -m gpu`)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.engines.megatron.rank import engine, rank_batch, weights_out
from tests.engines.megatron.test_trainer import SHAPE
from tests.ports import free_port
from timeshare.engines.megatron.optimizers import DistributedAdam
from timeshare.engines.megatron.trainer import MegatronTrainer
from timeshare.engines.model_dir import init_model_dir


def device_bytes(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """A host copy of each distinct storage's bytes, by storage."""
    out = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in out:
            flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            out[storage._cdata] = flat.cpu()
    return out


@pytest.mark.gpu
def test_megatron_ddp_and_distributed_optimizer_train_offload_and_resume(tmp_path: Path) -> None:
    model_dir = init_model_dir(tmp_path / "model", SHAPE, seed=0)
    spec = engine(model_dir, 1)  # device "auto": CUDA here
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        trainer = MegatronTrainer(0, 1, spec)
        assert trainer.device.type == "cuda"  # device "auto" on a GPU
        checkpoints = tmp_path / "checkpoints" / "rank0"
        assert trainer.bootstrap(checkpoints) == 0
        assert isinstance(trainer.optimizing, DistributedAdam)
        initial = weights_out(trainer)
        for step in range(2):
            figures = trainer.train_step(rank_batch(step + 1, 0, 1, version=step))
            assert figures.step == step + 1 and figures.extra["grad_norm"] > 0
        trained = weights_out(trainer)
        assert any(not trained[k].equal(initial[k]) for k in initial)
        # OFFLOAD: gradient buffers, master weights and Adam state leave the device.
        torch.cuda.synchronize()
        tensors = trainer.optimizing.tensors()
        before = device_bytes(tensors)
        allocated = torch.cuda.memory_allocated()
        trainer.offload()
        trainer.offload_params()
        torch.cuda.synchronize()
        assert trainer.held_mb() == 0.0
        assert allocated - torch.cuda.memory_allocated() >= sum(b.numel() for b in before.values())
        trainer.onload()
        after = device_bytes(tensors)
        assert all(before[k].equal(after[k]) for k in before)
        # A new trainer resumes from the committed step, with the same weights.
        again = MegatronTrainer(0, 1, spec)
        assert again.bootstrap(checkpoints) == 2
        resumed = weights_out(again)
        assert all(resumed[k].equal(trained[k].to(resumed[k].device)) for k in trained)
    finally:
        dist.destroy_process_group()
