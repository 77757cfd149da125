"""The `timeshare` weight-transfer backend: the receiving end of the weight channel, inside vLLM.

This module runs in each `VLLM::Worker` process (vLLM creates the backend there from
`weight_transfer_config={"backend": "timeshare"}`; plugin.py registers it). With tensor
parallelism N there are N of them, and the trainer's sender sends each version to all N at once
(protocols/weights/members.py): the backend of TP rank k joins the session as its member k and
hands every full tensor to its model's `load_weights`, whose weight loaders keep rank k's shard.
The rollout worker drives it through `LLM`'s own methods (engine.py), which reach here as:

    init_weight_transfer_engine  -> init_transfer_engine: where the trainer's sender is
    start_weight_update          -> start_weight_update: vLLM's layerwise reload begins
    update_weights               -> receive_weights: ONE WHOLE VERSION through the channel
    finish_weight_update         -> finish_weight_update: refuses a version that did not arrive
    shutdown_weight_transfer_engine -> shutdown

One `update_weights` call is one whole version, with the channel's deadlines (begin, per bucket,
finalize): it returns or raises within them, so the rollout worker never waits on vLLM without
an end. Each bucket goes through the model's own `load_weights` under vLLM's layerwise reload
(on CPU vLLM repacks linear weights after loading; loading into them directly fails), and the
post-load processing (`finalize_layerwise_reload`) runs inside the channel's finalize step:
the trainer sees FINALIZED only once the model is ready to generate with the new weights.

`weights_match`: on CPU the processed parameters are repacked (shape [0]) and cannot be read
back by the trainer's names, so the digest is that of what arrived at the model's loader, by
the trainer's names, bit for bit (`WeightsDigest`): the engine holds exactly what the loader was
given, and the loader's own failures are errors, never silent.

`TimeshareWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`) so the rollout
worker can read the last transfer's report by method name (`collective_rpc("timeshare_report")`):
no function objects, so no pickle. The report is a `LoadReport` (engines/load_report.py), as
msgpack bytes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec
import structlog
import torch

from timeshare.engines.digest import WeightsDigest
from timeshare.engines.load_report import LoadReport, LoadSeconds
from timeshare.engines.vllm.report import LOADER_REFUSED
from timeshare.errors import LoaderFailed, SessionClosed, TimeshareError
from timeshare.protocols.weights import TransferConfig, WeightReceiver
from timeshare.protocols.wire import error_text
from vllm.config.parallel import ParallelConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig, WeightTransferConfig

log = structlog.get_logger(__name__)


@runtime_checkable
class _LoadsWeights(Protocol):
    """What every vLLM model class has (by HF names), and `torch.nn.Module` does not declare."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


@dataclass
class TimeshareInitInfo(WeightTransferInitInfo):
    endpoint: str = ""  # the trainer's weight endpoint (weight_endpoint(runtime_dir, rank))
    transfer: dict[str, object] = field(default_factory=dict)  # TransferConfig, as plain values


@dataclass
class TimeshareUpdateInfo(WeightTransferUpdateInfo):
    begin_timeout_s: float = 30.0  # the wait for the trainer to begin sending
    digest: bool = True  # hash what arrives (weights_match); off only to measure the channel


class TimeshareWeightTransfer(WeightTransferEngine[TimeshareInitInfo, TimeshareUpdateInfo]):
    init_info_cls = TimeshareInitInfo
    update_info_cls = TimeshareUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.endpoint = ""
        self.transfer = TransferConfig()
        self.receiver: WeightReceiver | None = None

        self.report: LoadReport | None = None  # the last whole version, None while torn

    def init_transfer_engine(self, init_info: TimeshareInitInfo) -> None:
        if not init_info.endpoint:
            raise TimeshareError("timeshare weight transfer: init_info names no endpoint")
        self.endpoint = init_info.endpoint
        self.transfer = msgspec.convert(init_info.transfer, TransferConfig)
        self._close_receiver()
        self.receiver = self._new_receiver()

    def start_weight_update(self) -> None:
        self.report = None
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: TimeshareUpdateInfo) -> None:
        receiver = self._usable_receiver()
        digest = WeightsDigest() if update_info.digest else None
        model = self.model
        if not isinstance(model, _LoadsWeights):  # (was the AttributeError reading it)
            raise AttributeError(f"vLLM's model {type(model).__name__} has no load_weights")
        load_weights = model.load_weights

        # Where a version's time goes inside vLLM's worker (in the report: the benchmark shows it).
        spent = LoadSeconds()

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            # (Hashing in a thread beside vLLM's load gained nothing here: vLLM's CPU worker
            # keeps every core busy. Measured with benchmarks/vllm_sync.py.)
            mark = time.perf_counter()
            if digest is not None:
                for name, tensor in named:
                    digest.add(name, tensor)
            spent.digest_s += (now := time.perf_counter()) - mark
            mark = now
            # Layerwise reload keeps a layer's tensors until the layer is whole, which may be in
            # a later bucket: it gets copies, never views of staging (reused after the ACK).
            copies = [(name, tensor.clone()) for name, tensor in named]
            spent.copy_s += (now := time.perf_counter()) - mark
            mark = now
            try:
                load_weights(copies)
            except Exception as exc:  # the trainer sees this as PeerError: say whose loader
                raise LoaderFailed(
                    f"{LOADER_REFUSED} {type(model).__name__} refused "
                    f"{[name for name, _ in named][:4]}...: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                copies.clear()
                spent.load_s += time.perf_counter() - mark

        def post_process() -> None:
            mark = time.perf_counter()
            _finalize_reload(model, self.model_config)
            spent.finalize_s += time.perf_counter() - mark

        started = time.perf_counter()
        try:
            report = receiver.receive(load, post_process, timeout_s=update_info.begin_timeout_s)
        except BaseException:
            self._abandon_reload()
            raise
        self.report = LoadReport(
            transfer=report,
            digest="" if digest is None else digest.hexdigest(),
            call_s=time.perf_counter() - started,
            spent=spent,
            worker=receiver.member,
            tensors={} if digest is None else digest.table(),
        )

    def finish_weight_update(self) -> None:
        if self.report is None:
            raise TimeshareError(
                "timeshare weight transfer: finish_weight_update without a whole version "
                "(update_weights failed or was not called)"
            )

    def shutdown(self) -> None:
        self._close_receiver()

    # -- helpers --------------------------------------------------------------------------------

    def _usable_receiver(self) -> WeightReceiver:
        """The receiver, or a new one after a failed session (a failure closes a session)."""
        if not self.endpoint:
            raise TimeshareError("timeshare weight transfer: init_weight_transfer_engine first")
        receiver = self.receiver
        if receiver is None or receiver.closed:
            self._close_receiver()
            receiver = self.receiver = self._new_receiver()
        return receiver

    def _new_receiver(self) -> WeightReceiver:
        """This worker's receiver: member k of the engine's N tensor-parallel workers."""
        member, members = tensor_parallel_member(self.parallel_config)
        return WeightReceiver(
            self.endpoint, self.transfer, device=str(self.device), member=member, members=members
        )

    def _abandon_reload(self) -> None:
        """A failed version: end the layerwise reload so the next one starts clean (torn)."""
        try:
            _finalize_reload(self.model, self.model_config)
        except Exception as exc:  # the transfer's own failure is what the caller must see
            log.warning("vllm.backend.reload_not_ended", error=f"{type(exc).__name__}: {exc}")

    def _close_receiver(self) -> None:
        if self.receiver is not None:
            with contextlib.suppress(SessionClosed):
                self.receiver.close()
            self.receiver = None


def tensor_parallel_member(parallel: ParallelConfig) -> tuple[int, int]:
    """(this worker's TP rank, the TP size): which member of the weight session it is.

    Every TP worker of the engine holds a shard of every layer, so each loads every version;
    a pipeline-parallel stage would hold only some layers, which the session does not plan
    (each member is sent every tensor), so it is refused by name."""
    if parallel.pipeline_parallel_size != 1:
        raise TimeshareError(
            "timeshare weight transfer: pipeline_parallel_size "
            f"{parallel.pipeline_parallel_size} is not supported (tensor parallelism is)"
        )
    return get_tensor_model_parallel_rank(), parallel.tensor_parallel_size


# The worker's weight-transfer steps `timeshare_step` runs, and how each takes its arguments.
STEPS = {
    "init_weight_transfer_engine": ("init_info",),
    "start_weight_update": (),
    "update_weights": ("update_info",),
    "finish_weight_update": (),
    "shutdown_weight_transfer_engine": (),
}


class TimeshareWorkerExtension:
    """Methods mixed into vLLM's worker, called by name through `collective_rpc`."""

    weight_transfer_engine: (
        WeightTransferEngine[WeightTransferInitInfo, WeightTransferUpdateInfo] | None
    )

    def timeshare_step(self, step: str, arguments: dict[str, object]) -> str | None:
        """Run the worker's own weight-transfer step `step` (one of STEPS), with `arguments`;
        answer None, or what it raised as text (engine.py says why it never raises)."""
        if step not in STEPS or set(arguments) != set(STEPS[step]):
            return f"TimeshareError: no weight-transfer step {step}({', '.join(arguments)})"
        try:
            getattr(self, step)(*(arguments[name] for name in STEPS[step]))
        except Exception as exc:
            kind, message = error_text(exc)
            return f"{kind}: {message}"
        return None

    def timeshare_batch_invariant(self) -> bool:
        """Whether vLLM runs this worker with its batch-invariant kernels: VLLM_BATCH_INVARIANT
        as vLLM reads it in this process (a forked process's /proc/<pid>/environ would show
        its parent's environment as it was exec'd, not this)."""
        from vllm import envs  # noqa: PLC0415

        return bool(envs.VLLM_BATCH_INVARIANT)

    def timeshare_report(self) -> bytes | None:
        """The last whole version this worker received, a `LoadReport` as msgpack (None:
        none, or the last one failed)."""
        engine = self.weight_transfer_engine
        if not isinstance(engine, TimeshareWeightTransfer):
            raise TimeshareError(
                "timeshare_report: this engine's weight_transfer_config backend is not timeshare"
            )
        return None if engine.report is None else engine.report.encode()


def _finalize_reload(model: torch.nn.Module, model_config: object) -> None:
    """vLLM's end of a layerwise reload (its processing of the loaded weights), typed."""
    finalize_layerwise_reload(model, model_config)  # type: ignore[no-untyped-call]  # vLLM's is (*args, **kwargs)
