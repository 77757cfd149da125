"""On CUDA, the FSDP trainer's offload really frees device memory and brings it back bit for bit
(one rank, NCCL; run where a GPU is: `pytest -m gpu`)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.engines.fsdp.rank import engine, rank_batch, snapshot
from tests.engines.fsdp.test_trainer import SHAPE
from tests.ports import free_port
from timeshare.engines.fsdp.trainer import FsdpTrainer
from timeshare.engines.model_dir import init_model_dir


@pytest.mark.gpu
def test_offload_frees_device_memory_and_onload_restores_it(tmp_path: Path) -> None:
    model_dir = init_model_dir(tmp_path / "model", SHAPE, seed=0)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        trainer = FsdpTrainer(0, 1, engine(model_dir, device="cuda"))
        trainer.build()
        batch = rank_batch(1, 0, 1)
        trainer.accumulate_gradients(trainer.prepare(batch), range(len(batch)))
        trainer.apply_gradients()  # AdamW state exists now
        trainer.accumulate_gradients(trainer.prepare(batch), range(len(batch)))  # and gradients
        torch.cuda.synchronize()
        before, held = snapshot(trainer), torch.cuda.memory_allocated()
        free_before = torch.cuda.mem_get_info()[0]
        trainer.offload()
        trainer.offload_params()
        torch.cuda.synchronize()
        assert trainer.held_mb() == 0.0
        freed = held - torch.cuda.memory_allocated()
        assert freed >= sum(t.nbytes for t in before.values()) * 0.99
        assert torch.cuda.mem_get_info()[0] > free_before  # returned to the device, not cached
        assert torch.cuda.memory_allocated() < 1 << 20  # nothing else of the trainer's stays
        trainer.onload()
        after = snapshot(trainer)
        assert before.keys() == after.keys()
        for key, tensor in before.items():
            assert torch.equal(
                tensor.reshape(-1).view(torch.uint8).cpu(),
                after[key].reshape(-1).view(torch.uint8).cpu(),
            ), key
        # and it trains on from there
        trainer.apply_gradients()
        assert trainer.held_mb() > 0.0
    finally:
        dist.destroy_process_group()
