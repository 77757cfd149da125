"""CUDA tensors through the shared-memory channel (the CUDA IPC transport comes later)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_cuda_weights_arrive_bit_identical_on_a_cuda_receiver(runtime_dir: Path) -> None:
    cfg = TransferConfig(bucket_mb=0.25, ack_timeout_s=30.0)
    url = f"ipc://{runtime_dir}/w.sock"
    weights = {
        "big": torch.randn(300, 1000, device="cuda"),
        "bf16": torch.randn(64, 48, device="cuda").bfloat16().t(),
        "int": torch.arange(100, device="cuda"),
    }
    got: dict[str, torch.Tensor] = {}

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            got[name] = tensor.to("cuda", non_blocking=True)  # fenced before the ACK

    def receive() -> None:
        with WeightReceiver(url, cfg, device="cuda") as receiver:
            receiver.receive(load)

    thread = threading.Thread(target=receive)
    thread.start()
    with WeightSender(url, cfg) as sender:
        await sender.send(weights, version=1)
    thread.join(timeout=60)
    for name, tensor in weights.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].cpu(), tensor.cpu())
