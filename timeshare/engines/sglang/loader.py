"""timeshare's weight loader inside SGLang's scheduler: the receiving end of the weight channel.

SGLang calls a loader named in `custom_weight_loader` with its model, inside the scheduler
process, when `update_weights_from_tensor(..., load_format=<that name>)` arrives there
(engine.py sends one whose only entry names a `LoadOrder`, order.py). With tensor parallelism
every TP rank's scheduler gets the order, and each joins the version's session as its member
(its TP rank): the trainer's sender sends each bucket once, to all of them, and each rank's
weight loaders keep its shard of the full tensors. `receive_version` then receives ONE WHOLE
VERSION through the channel with its deadlines (begin, per bucket, finalize):

- each bucket goes through the model's own `load_weights` by HF names: SGLang stacks q/k/v and
  gate/up itself, as when it loads a checkpoint;
- SGLang's post-load step (`DefaultModelLoader.postprocess_weights`: repacking, quantising) runs
  inside the channel's finalize, so the trainer sees FINALIZED only once the model is ready;
- what arrived at the loader is hashed by the trainer's names (`weights_match`): SGLang's
  stacked parameters cannot be read back by those names;
- each weight is checked against the model's checkpoint, by name and shape: the safetensors
  SGLang started from (their headers), or, where it started from dummy weights, the checkpoint
  the model's config describes (transformers' class of its architecture, on the meta device).
  SGLang's `load_weights` skips a name it does not know without a word; a refusal must be loud.

It never raises into SGLang: an exception there ends SGLang's scheduler (and signals its
parent). Whatever happens, it writes a `LoadOutcome` where the order says, and the rollout
worker raises the typed error from it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch

from timeshare.engines.digest import WeightsDigest
from timeshare.engines.load_report import LoadReport, LoadSeconds
from timeshare.engines.sglang.order import LoadOrder, LoadOutcome
from timeshare.errors import LoaderFailed, SessionClosed
from timeshare.protocols.weights import WeightReceiver

log = structlog.get_logger(__name__)

NAME = "timeshare.engines.sglang.loader.receive_version"  # as SGLang imports it (dotted)
_receivers: dict[str, WeightReceiver] = {}  # by endpoint: one session per rank, kept open
_checkpoints: dict[str, dict[str, tuple[int, ...]] | None] = {}  # by model dir: name -> shape
_hashing = ThreadPoolExecutor(1, thread_name_prefix="timeshare-digest")  # started on first use


def receive_version(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom loader: the order in `named_tensors`, the weights through the channel."""
    order: LoadOrder | None = None
    worker = 0
    try:
        (name, _), *rest = named_tensors
        if rest:
            raise LoaderFailed("timeshare's SGLang loader takes one order, not weights")
        order = LoadOrder.from_name(name)
        worker = _tp_rank(order)
        outcome = LoadOutcome(report=_receive(model, order, worker))
    except LoaderFailed as exc:
        outcome = LoadOutcome(failure="loader", error=str(exc))
    except Exception as exc:  # never into SGLang's scheduler (module docstring)
        outcome = LoadOutcome(failure="transfer", error=f"{type(exc).__name__}: {exc}")
    if order is None:
        log.error("sglang.loader.no_order", error=outcome.error)
        return
    if outcome.failure:
        _close(order.endpoint)  # a failure ends the session: the next version opens a new one
    outcome.write(order.answer_of(worker))


def _tp_rank(order: LoadOrder) -> int:
    """This scheduler's TP rank, checked against the size the order was made for."""
    from sglang.srt.distributed.parallel_state import (  # noqa: PLC0415 - in the scheduler
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    size = int(get_tensor_model_parallel_world_size())
    if size != order.workers:
        raise LoaderFailed(
            f"timeshare's SGLang loader: the order is for {order.workers} TP ranks, SGLang runs "
            f"{size}"
        )
    return int(get_tensor_model_parallel_rank())


def _receive(model: Any, order: LoadOrder, worker: int) -> LoadReport:
    device = next(model.parameters()).device
    receiver = _receiver(order, str(device), worker)
    digest = WeightsDigest() if order.digest else None
    spent = LoadSeconds()
    load_weights = model.load_weights
    shapes = _checkpoint_shapes(model, order.model_dir)

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        if shapes is not None:
            _check_against(model, shapes, named)
        # The digest hashes the bucket in a thread while SGLang loads it (hashlib and torch's
        # copies release the GIL): both read staging, which is reused once this returns.
        hashing = _hashing.submit(_add_to, digest, named, spent) if digest is not None else None
        mark = time.perf_counter()
        try:
            # SGLang's weight loaders copy into its parameters: views of staging are enough.
            load_weights(named)
        except Exception as exc:  # the trainer sees this as PeerError: say whose loader
            raise LoaderFailed(
                f"SGLang's loader of {type(model).__name__} refused "
                f"{[name for name, _ in named][:4]}...: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            spent.load_s += time.perf_counter() - mark
            if hashing is not None:
                hashing.result()

    def post_process() -> None:
        from sglang.srt.model_loader.loader import DefaultModelLoader  # noqa: PLC0415

        mark = time.perf_counter()
        DefaultModelLoader.postprocess_weights(model, device)
        spent.finalize_s += time.perf_counter() - mark

    started = time.perf_counter()
    report = receiver.receive(load, post_process, timeout_s=order.begin_timeout_s)
    return LoadReport(
        transfer=report,
        digest="" if digest is None else digest.hexdigest(),
        call_s=time.perf_counter() - started,
        spent=spent,
        worker=worker,
        tensors={} if digest is None else digest.table(),
    )


def _add_to(
    digest: WeightsDigest, named: list[tuple[str, torch.Tensor]], spent: LoadSeconds
) -> None:
    mark = time.perf_counter()
    for name, tensor in named:
        digest.add(name, tensor)
    spent.digest_s += time.perf_counter() - mark


def _checkpoint_shapes(model: Any, model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """The names and shapes of `model`'s checkpoint (None: not known, and names are not
    checked: logged)."""
    if model_dir not in _checkpoints:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        _checkpoints[model_dir] = _shapes_in(files) if files else _shapes_of(model)
    return _checkpoints[model_dir]


def _shapes_in(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Names and shapes from safetensors headers (no tensor is read)."""
    from safetensors import safe_open  # noqa: PLC0415

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    return shapes


def _shapes_of(model: Any) -> dict[str, tuple[int, ...]] | None:
    """The checkpoint the model's config describes: transformers' class of its architecture."""
    import transformers  # noqa: PLC0415 - the scheduler's process has it; the rest need not

    config = model.config
    architecture = (getattr(config, "architectures", None) or [""])[0]
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        log.warning("sglang.loader.names_unchecked", architecture=architecture)
        return None
    with torch.device("meta"):
        reference = model_class(config)
    return {name: tuple(tensor.shape) for name, tensor in reference.state_dict().items()}


def _check_against(
    model: Any, shapes: dict[str, tuple[int, ...]], named: list[tuple[str, torch.Tensor]]
) -> None:
    for name, tensor in named:
        expected = shapes.get(name)
        if expected is None:
            problem = "no weight of its checkpoint has this name"
        elif tuple(tensor.shape) != expected:
            problem = f"shape {tuple(tensor.shape)}, its checkpoint's is {expected}"
        else:
            continue
        raise LoaderFailed(f"SGLang's loader of {type(model).__name__} refused {name!r}: {problem}")


def _receiver(order: LoadOrder, device: str, worker: int) -> WeightReceiver:
    """This TP rank's receiver, or a new one (a first order, or the last session failed)."""
    receiver = _receivers.get(order.endpoint)
    if receiver is None or receiver.closed:
        _close(order.endpoint)
        receiver = _receivers[order.endpoint] = WeightReceiver(
            order.endpoint, order.transfer, device=device, member=worker, members=order.workers
        )
    return receiver


def _close(endpoint: str) -> None:
    receiver = _receivers.pop(endpoint, None)
    if receiver is not None:
        with contextlib.suppress(SessionClosed):
            receiver.close()


def close_all() -> None:
    """The scheduler is ending (SGLang's plugin registers this at exit)."""
    for endpoint in list(_receivers):
        _close(endpoint)
