"""The worker process: one engine side (trainer or rollout) of one rank, driven over the lanes.

    python -m timeshare.engines.worker '<WorkerSpec as JSON>'

The driver spawns one trainer and one rollout worker per rank, each in its own process group.
Every phase is a command on the work lane, sent to both workers of the rank; a worker with
nothing to do in a phase answers at once. SYNC runs on both: the trainer sends its weights
through the weight channel while the rollout receives them. Injected faults (for tests and
drills) fire as a phase starts: raise, hang (no progress: the driver sees a stall) or SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any, Literal

import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal

from timeshare.engines.base import RolloutRequest, SamplingParams
from timeshare.engines.simulated import (
    DeviceLedger,
    SimulatedRollout,
    SimulatedSpec,
    SimulatedTrainer,
)
from timeshare.protocols.commands import WorkerServer
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import (
    TransferConfig,
    TransferReport,
    WeightReceiver,
    WeightSender,
)

Role = Literal["trainer", "rollout"]
FaultKind = Literal["raise", "hang", "kill"]


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Make `role` of `rank` fail as `phase` (of `step`, or of any step) starts."""

    role: str
    rank: int
    phase: str
    kind: FaultKind
    step: int | None = None


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: Role
    rank: int
    world_size: int
    work_endpoint: str
    control_endpoint: str
    weight_endpoint: str
    store_host: str
    store_port: int
    checkpoint_dir: str
    transfer: TransferConfig = TransferConfig(bucket_mb=1.0)
    engine: SimulatedSpec = SimulatedSpec()
    faults: list[Fault] = []
    heartbeat_s: float = 0.2
    rollout_batch: int = 4


class SimulatedFault(Exception):
    """Raised by an injected `raise` fault."""


def fire_faults(spec: WorkerSpec, phase: str, step: int | None) -> None:
    for fault in spec.faults:
        if (fault.role, fault.rank, fault.phase) != (spec.role, spec.rank, phase):
            continue
        if fault.step is not None and fault.step != step:
            continue
        if fault.kind == "raise":
            raise SimulatedFault(f"injected fault in {phase}")
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait()  # hang: no progress until aborted or killed


def transfer_result(report: TransferReport) -> dict[str, Any]:
    """A transfer's report as a SYNC command's result."""
    return {
        "version": report.version,
        "bytes": report.bytes,
        "tensors": report.tensors,
        "buckets": report.buckets,
        "seconds": report.seconds,
        "checksummed": report.checksummed,
    }


class TrainerWorker:
    def __init__(
        self, spec: WorkerSpec, ledger: DeviceLedger, portal: BlockingPortal, server: WorkerServer
    ) -> None:
        self.spec = spec
        self.server = server
        self.engine = SimulatedTrainer(spec.rank, spec.engine, ledger)
        self.engine.progress = server.report_progress
        self.portal = portal
        self.sender = WeightSender(spec.weight_endpoint, spec.transfer)

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {
            "bootstrap": self.bootstrap,
            "train": self.train,
            "offload": self.offload,
            "sync": self.sync,
            "barrier": self.barrier,
            "resume": lambda params: None,
            "rollout": lambda params: None,
        }

    def bootstrap(self, params: dict[str, Any]) -> dict[str, Any]:
        self.engine.load_checkpoint(Path(self.spec.checkpoint_dir))
        self.engine.hold_params()
        return {"step": self.engine.step}

    def train(self, params: dict[str, Any]) -> dict[str, float]:
        return self.engine.train_step([])

    def offload(self, params: dict[str, Any]) -> None:
        self.engine.offload()

    def sync(self, params: dict[str, Any]) -> dict[str, Any]:
        self.engine.hold_staging()
        weights = list(self.engine.iter_weights())
        with self.server.waiting_on_peer():
            report = self.portal.call(partial(self.sender.send, weights, version=self.engine.step))
        self.engine.free_staging()
        self.engine.delay("sync")
        self.engine.offload_params()
        return {**transfer_result(report), "staging_buffers": self.sender.staging_buffers}

    def barrier(self, params: dict[str, Any]) -> dict[str, float]:
        self.engine.delay("barrier")
        return {"held_mb": self.engine.held_mb()}

    def close(self) -> None:
        self.sender.close()


class RolloutWorker:
    def __init__(self, spec: WorkerSpec, ledger: DeviceLedger, server: WorkerServer) -> None:
        self.spec = spec
        self.engine = SimulatedRollout(spec.rank, spec.engine, ledger)
        self.engine.progress = server.report_progress
        self.receiver = WeightReceiver(spec.weight_endpoint, spec.transfer)
        self.server = server

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {
            "bootstrap": lambda params: None,
            "train": lambda params: None,
            "offload": lambda params: None,
            "sync": self.sync,
            "barrier": lambda params: None,
            "resume": self.resume,
            "rollout": self.rollout,
        }

    def sync(self, params: dict[str, Any]) -> dict[str, Any]:
        self.engine.begin_weight_update()
        self.engine.wake({"weights"})

        def load(named: list[Any]) -> None:
            self.engine.load_weights(named)
            self.server.report_progress()

        with self.server.waiting_on_peer():
            report = self.receiver.receive(load)  # within the config's begin_timeout_s
        self.engine.finish_weight_update(report.version)
        return transfer_result(report)

    def resume(self, params: dict[str, Any]) -> None:
        self.engine.wake({"kv_cache"})

    def rollout(self, params: dict[str, Any]) -> dict[str, Any]:
        requests = [
            RolloutRequest(f"r{self.spec.rank}-{i}", (1, 2, 3), SamplingParams(max_tokens=4))
            for i in range(self.spec.rollout_batch)
        ]
        samples = self.engine.generate(requests)
        self.engine.sleep()
        return {"samples": len(samples), "version": samples[0].weight_version if samples else None}

    def close(self) -> None:
        self.receiver.close()


def run(spec: WorkerSpec) -> None:
    store = JobStore.connect(spec.store_host, spec.store_port, timeout_s=30.0)
    ledger = DeviceLedger(store, spec.engine.sizes.device_mb, enabled=spec.engine.account_memory)
    handlers: dict[str, Callable[[dict[str, Any]], Any]] = {}
    server = WorkerServer(
        work_endpoint=spec.work_endpoint,
        control_endpoint=spec.control_endpoint,
        role=spec.role,
        rank=spec.rank,
        handlers=handlers,
        heartbeat_s=spec.heartbeat_s,
    )
    with ExitStack() as stack:
        worker: TrainerWorker | RolloutWorker
        if spec.role == "trainer":
            portal = stack.enter_context(start_blocking_portal())
            worker = TrainerWorker(spec, ledger, portal, server)
        else:
            worker = RolloutWorker(spec, ledger, server)
        stack.callback(worker.close)
        for name, handler in worker.handlers().items():
            handlers[name] = _with_faults(spec, name, handler)
        server.serve()


def _with_faults(
    spec: WorkerSpec, phase: str, handler: Callable[[dict[str, Any]], Any]
) -> Callable[[dict[str, Any]], Any]:
    def run_phase(params: dict[str, Any]) -> Any:
        fire_faults(spec, phase, params.get("step"))
        return handler(params)

    return run_phase


def main() -> None:
    spec = msgspec.json.decode(sys.argv[1], type=WorkerSpec)
    run(spec)


if __name__ == "__main__":
    main()
