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
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Literal

import msgspec
import structlog

from timeshare import logs
from timeshare.cluster import group_leader, group_ranks
from timeshare.engines.base import RolloutEngine, RolloutSample, TrainerEngine
from timeshare.engines.context import EngineContext
from timeshare.engines.digest import WeightsDigest
from timeshare.engines.drift import ChecksSection, drift
from timeshare.engines.faults import Fault
from timeshare.engines.handoff import (
    CALL_TIMEOUT_S,
    COLLECTIVE_TIMEOUT_S,
    GENERATE_TIMEOUT_S,
    KEEP_CHECKPOINTS,
)
from timeshare.engines.main_loop import MainThreadLoop
from timeshare.engines.outlet import digested, drain
from timeshare.engines.pairs import build_rollout, build_trainer, workload_of
from timeshare.engines.spec import EngineSpec
from timeshare.engines.task import Scoring, Workload
from timeshare.errors import ProtocolError, SimulatedFault, TimeshareError
from timeshare.protocols.commands import WorkerServer
from timeshare.protocols.commands.params import PhaseParams
from timeshare.protocols.commands.params import decode as decode_params
from timeshare.protocols.commands.results import (
    BootstrapResult,
    CommandResult,
    HeldResult,
    RolloutResult,
    SyncResult,
    TablesResult,
    TrainResult,
    WorkerLoad,
)
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import (
    TransferConfig,
    TransferReport,
    WeightSender,
)
from timeshare.timing import Span, Spans

Role = Literal["trainer", "rollout"]


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
    transfer: TransferConfig  # the job's [transfer]: both ends of a channel use the same
    runtime_dir: str = ""  # the job's (what an engine's own processes leave is recorded there)
    engine: EngineSpec = EngineSpec()
    checks: ChecksSection = ChecksSection()
    faults: list[Fault] = []
    heartbeat_s: float = 0.2
    # (context.py states what each is, and its default)
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    engine_call_timeout_s: float = CALL_TIMEOUT_S
    generate_timeout_s: float = GENERATE_TIMEOUT_S
    log_file: str = ""
    log_level: str = "info"
    log_max_mb: float = 0.0  # the job's [log] rotation: every writer of the file follows it
    log_keep: int = 0
    resume_on_fewer_ranks: bool = False  # [cluster] min_nodes set: a checkpoint is resharded
    keep_checkpoints: int = KEEP_CHECKPOINTS
    run_dir: str = ""  # the run's directory: samples.jsonl, reward_errors.jsonl ("": none)
    samples_per_step: int = 0  # [log] samples_per_step


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


Handler = Callable[[PhaseParams], CommandResult]
NOTHING_TO_DO: Handler = lambda params: CommandResult()  # noqa: E731 - a phase of the other side


def sync_result(
    report: TransferReport,
    digest: str,
    staging_buffers: int | None = None,
    *,
    receivers: int = 1,
    workers: Sequence[WorkerLoad] = (),
) -> SyncResult:
    """A transfer's report as a SYNC command's result, less its spans: the command's own
    spans hold them already (they travel once)."""
    transfer = msgspec.structs.replace(report, spans=())
    return SyncResult(
        transfer=transfer,
        digest=digest,
        staging_buffers=staging_buffers,
        receivers=receivers,
        workers=list(workers),
    )


class TrainerWorker:
    def __init__(
        self,
        spec: WorkerSpec,
        engine: TrainerEngine,
        server: WorkerServer,
    ) -> None:
        self.spec = spec
        self.server = server
        self.engine = engine
        self.engine.progress = server.report_progress
        self.loop = MainThreadLoop(server)  # the sender's, on this (the main) thread
        # One session into every worker of the rollout engine (its tensor-parallel workers
        # each load every bucket): protocols/weights/members.py. An engine spanning a group
        # of ranks is sent to by the group's first rank alone; the others only take part in
        # the collectives producing the weights (outlet.drain).
        workers = spec.engine.rollout_workers()
        self.sender: WeightSender | None = None
        if group_leader(spec.rank, workers) == spec.rank:
            self.sender = WeightSender(spec.weight_endpoint, spec.transfer, receivers=workers)
        # Within the current command (the trace shows them); each stretch that ends is progress
        # (waking weights, preparing, sleeping: none is a stall of its own).
        self.spans = Spans(on_end=server.report_progress)
        # The last SYNC's version and digest, whose per-tensor lines `tables` answers with.
        self.last_sync: tuple[int, WeightsDigest] | None = None

    def handlers(self) -> dict[str, Handler]:
        return {
            "bootstrap": self.bootstrap,
            "train": self.train,
            "offload": self.offload,
            "sync": self.sync,
            "barrier": self.held,
            "resume": NOTHING_TO_DO,
            "rollout": NOTHING_TO_DO,
            "held": self.held,
            "tables": self.tables,
        }

    def bootstrap(self, params: PhaseParams) -> BootstrapResult:
        step = self.engine.bootstrap(Path(self.spec.checkpoint_dir))
        return BootstrapResult(step=step, train=self.engine.last_train)

    def train(self, params: PhaseParams) -> TrainResult:
        batch = _decoded_samples(params.batch)
        return TrainResult(figures=self.engine.train_step(batch))

    def offload(self, params: PhaseParams) -> CommandResult:
        self.engine.offload()
        return CommandResult()

    def sync(self, params: PhaseParams) -> SyncResult:
        with self.spans.span("prepare"):
            self.engine.prepare_sync()
        digest = WeightsDigest()
        self.last_sync = (self.engine.step, digest)
        if self.sender is None:
            return self.sync_without_sending(digest)
        weights = digested(self.engine.iter_weights(), digest)
        with self.server.waiting_on_peer(), self.spans.span("send"):
            send = partial(self.sender.send, weights, version=self.engine.step)
            report = self.loop.run(send, "sync")
        self.spans.extend(report.spans)
        self.finish_sync()
        return sync_result(
            report,
            digest.hexdigest(),
            self.sender.staging_buffers,
            receivers=self.sender.receivers,
        )

    def sync_without_sending(self, digest: WeightsDigest) -> SyncResult:
        """SYNC on a rank whose rollout another rank's engine serves: the weights produced in
        step with the sending rank (its collectives), digested, sent nowhere."""
        leader = group_leader(self.spec.rank, self.spec.engine.rollout_workers())
        started = time.perf_counter()
        with self.server.waiting_on_peer(), self.spans.span("produce"):
            produced = drain(self.engine.iter_weights(), digest, self.spec.transfer.bucket_bytes)
        seconds = time.perf_counter() - started
        self.finish_sync()
        tensors, nbytes = produced
        report = TransferReport(self.engine.step, nbytes, tensors, 0, seconds)
        return SyncResult(transfer=report, digest=digest.hexdigest(), receivers=0, served_by=leader)

    def finish_sync(self) -> None:
        with self.spans.span("offload params"):
            self.engine.finish_sync()
            self.engine.offload_params()

    def held(self, params: PhaseParams) -> HeldResult:
        return HeldResult(held_mb=self.engine.held_mb())

    def tables(self, params: PhaseParams) -> TablesResult:
        """The per-tensor lines of what the last SYNC sent (or produced)."""
        if self.last_sync is None:
            raise TimeshareError("tables: this trainer has not synced a version yet")
        version, digest = self.last_sync
        return TablesResult(version=version, tensors=digest.table())

    def close(self) -> None:
        try:
            if self.sender is not None:
                self.sender.close()
        finally:
            try:
                self.loop.close()
            finally:
                self.engine.close()


class RolloutWorker:
    """A rank's rollout worker with its engine, which serves `ranks` (this one, or with tensor
    parallelism the group of ranks whose devices its workers hold: cluster.group_ranks)."""

    def __init__(
        self,
        spec: WorkerSpec,
        engine: RolloutEngine,
        workload: Workload,
        server: WorkerServer,
        ranks: range | None = None,
    ) -> None:
        self.spec = spec
        self.ranks = ranks or range(spec.rank, spec.rank + 1)
        self.engine = engine
        self.engine.progress = server.report_progress
        self.workload = workload
        self.inlet = engine.open_inlet(spec.weight_endpoint, spec.transfer)
        self.server = server
        # Within the current command (the trace shows them); each stretch that ends is progress
        # (waking weights, preparing, sleeping: none is a stall of its own).
        self.spans = Spans(on_end=server.report_progress)

    def handlers(self) -> dict[str, Handler]:
        return {
            "bootstrap": NOTHING_TO_DO,
            "train": NOTHING_TO_DO,
            "offload": NOTHING_TO_DO,
            "sync": self.sync,
            "barrier": NOTHING_TO_DO,
            "resume": self.resume,
            "rollout": self.rollout,
            "held": self.held,
            "tables": self.tables,
        }

    def sync(self, params: PhaseParams) -> SyncResult:
        self.engine.begin_weight_update()
        with self.spans.span("wake weights"):
            self.engine.wake({"weights"})
        with self.server.waiting_on_peer(), self.spans.span("receive"):
            report = self.inlet.receive(self.server.report_progress)
        self.spans.extend(report.spans)
        return sync_result(report, self.engine.digest(), workers=self.engine.worker_loads)

    def resume(self, params: PhaseParams) -> CommandResult:
        with self.spans.span("wake kv_cache"):
            self.engine.wake({"kv_cache"})
        return CommandResult()

    def held(self, params: PhaseParams) -> HeldResult:
        return HeldResult(held_mb=self.engine.held_mb(), resident_mb=self.engine.resident_mb())

    def tables(self, params: PhaseParams) -> TablesResult:
        """The per-tensor lines of the version the engine holds: its own and each TP
        worker's (what each one's digest in the SYNC result is of)."""
        version = self.engine.weight_version
        if version is None:
            raise TimeshareError("tables: this rollout has loaded no version yet")
        tensors = self.engine.table()
        return TablesResult(version=version, tensors=tensors, workers=self.engine.worker_tables)

    def rollout(self, params: PhaseParams) -> RolloutResult:
        step = params.step or 0
        # Each rank's batch in a generate of its own: an engine seeds each request by its place
        # in the batch, so a rank samples what it would with an engine of its own. A batch is
        # scored while the engine generates the next (the reward function runs in processes
        # of its own: this worker reports progress while it waits on them).
        scoring = {rank: self.generate(rank, step) for rank in self.ranks}
        validated = self.validate(step)  # (its generate, while the batches are scored)
        with self.spans.span("score"):
            by_rank = {rank: pending.result() for rank, pending in scoring.items()}
        scored = by_rank[self.spec.rank]
        drift = self.drift(step, scored)
        with self.spans.span("sleep"):
            self.engine.sleep()
        rewards = [s.reward for s in scored if s.reward is not None]
        val = [s.reward for s in validated if s.reward is not None]
        return RolloutResult(
            samples=_encoded(scored),  # for the trainer, as it is
            version=scored[0].weight_version if scored else None,
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            resident_mb=self.engine.resident_mb(),
            batches={rank: _encoded(s) for rank, s in by_rank.items() if rank != self.spec.rank},
            invariance_max_abs_diff=drift,
            val_reward_mean=sum(val) / len(val) if val else None,
            val_samples=len(val),
        )

    def validate(self, step: int) -> list[RolloutSample]:
        """The validation prompts of every rank this engine serves, on their steps: generated
        with this ROLLOUT's weights and scored, never trained on."""
        requests = [r for rank in self.ranks for r in self.workload.validation(rank, step)]
        if not requests:
            return []
        with self.spans.span("validate"):
            samples = self.engine.generate(requests)
        with self.spans.span("score validation"):
            return self.workload.scored(requests, samples, step, self.server.report_progress)

    def drift(self, step: int, samples: list[RolloutSample]) -> float | None:
        """The drift probe (drift.py), on its steps."""
        checks = self.spec.checks
        if not checks.probes(step):
            return None
        temperature = self.spec.engine.task.temperature
        with self.spans.span("drift probe"):
            return drift(
                samples,
                lambda alone: self.engine.score(alone, temperature),
                checks.invariance_samples,
            )

    def generate(self, rank: int, step: int) -> Scoring:
        """Rank `rank`'s batch of step `step`, sampled, and being scored."""
        requests = self.workload.requests(rank, step)
        with self.spans.span("generate"):
            samples = self.engine.generate(requests)
        return self.workload.scoring(rank, step, requests, samples, self.server.report_progress)

    def close(self) -> None:
        self.inlet.close()


def _encoded(samples: list[RolloutSample]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(samples))


def _decoded_samples(batch: msgspec.Raw) -> list[RolloutSample]:
    """TRAIN's batch as the rollout encoded it (`_encoded`), passed on by the driver."""
    try:
        return msgspec.msgpack.decode(batch, type=list[RolloutSample])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad params for train: batch: {exc}") from exc


class ServedRollout:
    """The rollout worker of a rank whose rollout another rank's engine serves (the leader of
    its tensor-parallel group): no engine of its own; it answers every phase saying so."""

    def __init__(self, spec: WorkerSpec, leader: int) -> None:
        self.spec = spec
        self.leader = leader
        self.spans = Spans()

    def handlers(self) -> dict[str, Handler]:
        return {
            "bootstrap": NOTHING_TO_DO,
            "train": NOTHING_TO_DO,
            "offload": NOTHING_TO_DO,
            "sync": self.sync,
            "barrier": NOTHING_TO_DO,
            "resume": NOTHING_TO_DO,
            "rollout": self.rollout,
            "held": lambda params: HeldResult(held_mb=0.0),
        }

    def sync(self, params: PhaseParams) -> SyncResult:
        nothing = TransferReport(params.step or 0, 0, 0, 0, 0.0)
        return SyncResult(transfer=nothing, served_by=self.leader)

    def rollout(self, params: PhaseParams) -> RolloutResult:
        return RolloutResult(samples=_encoded([]), served_by=self.leader)

    def close(self) -> None:
        """Nothing to stop: the leader's worker holds the engine."""


def run(spec: WorkerSpec) -> None:
    logs.configure(spec.log_level, spec.log_file, max_mb=spec.log_max_mb, keep=spec.log_keep)
    structlog.contextvars.bind_contextvars(
        rank=spec.rank,
        role=spec.role,
        engine=spec.engine.trainer if spec.role == "trainer" else spec.engine.rollout,
    )
    store = JobStore.connect(spec.store_host, spec.store_port, timeout_s=30.0)
    handlers: dict[str, Callable[[msgspec.Raw], object]] = {}
    server = WorkerServer(
        work_endpoint=spec.work_endpoint,
        control_endpoint=spec.control_endpoint,
        role=spec.role,
        rank=spec.rank,
        handlers=handlers,
        heartbeat_s=spec.heartbeat_s,
    )
    with ExitStack() as stack:
        worker: TrainerWorker | RolloutWorker | ServedRollout
        context = EngineContext(
            spec=spec.engine,
            rank=spec.rank,
            world_size=spec.world_size,
            store=store,
            collective_timeout_s=spec.collective_timeout_s,
            call_timeout_s=spec.engine_call_timeout_s,
            runtime_dir=Path(spec.runtime_dir),
            generate_timeout_s=spec.generate_timeout_s,
            resume_on_fewer_ranks=spec.resume_on_fewer_ranks,
            keep_checkpoints=spec.keep_checkpoints,
            run_dir=Path(spec.run_dir) if spec.run_dir else None,
            samples_per_step=spec.samples_per_step,
        )
        group = spec.engine.rollout_workers()
        leader = group_leader(spec.rank, group)
        if spec.role == "trainer":
            worker = TrainerWorker(spec, build_trainer(context), server)
        elif leader != spec.rank:
            worker = ServedRollout(spec, leader)
        else:
            # The job's tokenizer is loaded here, once, before the engine starts: the rollout
            # worker is the one place that tokenizes (engines take and give tokens; trainers
            # train on the tokens sampled)
            workload = workload_of(context)
            stack.callback(workload.close)  # (the reward function's processes)
            rollout = build_rollout(context)
            stack.callback(rollout.close)  # the engine's processes stop even if the worker fails
            ranks = group_ranks(leader, group)
            worker = RolloutWorker(spec, rollout, workload, server, ranks)
        stack.callback(worker.close)
        for name, handler in worker.handlers().items():
            handlers[name] = _phase_handler(spec, name, handler, worker.spans)
        # The driver's shutdown is answered once the engines stopped their own processes (vLLM's):
        # after the answer the driver kills the worker's process group.
        handlers["shutdown"] = lambda params: stack.close()
        server.serve()


def _phase_handler(
    spec: WorkerSpec, phase: str, handler: Handler, spans: Spans
) -> Callable[[msgspec.Raw], CommandResult]:
    """Decode the phase's params, fire the faults injected for it, run it, and say how long the
    engine worked and where that time went: a span of the whole command (named after it), then
    those within."""

    def run_phase(raw: msgspec.Raw) -> CommandResult:
        structlog.contextvars.bind_contextvars(phase=phase, step=None)  # (until the params say)
        params = decode_params(raw, PhaseParams, phase)
        structlog.contextvars.bind_contextvars(step=params.step)
        fire_faults(spec, phase, params.step)
        spans.take()  # (what a failed command left)
        started = time.monotonic()
        result = handler(params)
        whole = Span(phase, started, time.monotonic() - started)
        return msgspec.structs.replace(result, engine_s=whole.seconds, spans=(whole, *spans.take()))

    return run_phase


def main() -> None:
    spec = msgspec.json.decode(sys.argv[1], type=WorkerSpec)
    run(spec)


if __name__ == "__main__":
    main()
