"""The SGLang rollout engine: SGLang's `Engine` inside the rollout worker process of one rank.

The worker process makes the `Engine`; SGLang starts its scheduler (which holds the model) and
detokenizer processes. Weights arrive in the scheduler through timeshare's loader (loader.py):
`SglangInlet` opens SGLang's weight-update session, has SGLang run the loader with a small order
(order.py), reads the loader's answer and closes the session. Every call into SGLang is bounded
by a deadline (a call past it leaves the engine unusable, and says so).

Generation: token-id prompts, each request with its own seed (the batch's seed and its index;
SGLang honours it through seeded_sampling.py), the logprobs of the sampled tokens (SGLang's
default: of the processed distribution, after temperature and top-p), and the weight version on
every sample. A completion stops at the first of its request's stop tokens (kept, with its
logprob) and at no other: request_stops.py keeps SGLang from adding the model's EOS. A generate
past its deadline is aborted inside SGLang, which is then waited idle: the engine stays usable.
Images and videos reach SGLang's `image_data`/`video_data` where the model takes them, each
checked to have a placeholder of its own in the prompt and to have been expanded by SGLang
(media.py: what SGLang would drop is refused naming the request); any medium is refused naming
the field on a text model.

Memory: `sleep()` waits for SGLang to be idle (its cache flushes only then: a release that races
a generate kills its scheduler) and releases weights and KV cache; `wake(tags)` brings back the
ones asked for (weights before SYNC, KV cache after BARRIER). Where torch_memory_saver cannot
free them (CPU) the engine says so: `held_mb` is 0 and `resident_mb` shows what stays.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from timeshare.engines.base import (
    FinishReason,
    RolloutRequest,
    RolloutSample,
    RolloutTraits,
    checked_finish_reason,
    refuse_unsupported,
)
from timeshare.engines.context import EngineContext
from timeshare.engines.cpu_binding import binding_environment, core_groups
from timeshare.engines.foreign import RELEASED, ForeignRollout, exited
from timeshare.engines.gpu_placement import group_devices
from timeshare.engines.load_report import LoadReport, worker_reports_checked
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.model_dir import write_config_dir
from timeshare.engines.patches import apply_patches
from timeshare.engines.sglang import loader
from timeshare.engines.sglang.boot import HOST_PID_ENV
from timeshare.engines.sglang.media import MediaPlaceholders
from timeshare.engines.sglang.order import LoadOrder, LoadOutcome
from timeshare.engines.sglang.own_shutdown import OWN_PROCESSES_ONLY, ending
from timeshare.engines.sglang.spec import SglangSpec
from timeshare.engines.task import mix
from timeshare.errors import (
    EngineBroken,
    GenerateTimeout,
    LoaderFailed,
    TimeshareError,
    TransferError,
)
from timeshare.protocols.weights import TransferConfig, TransferReport
from timeshare.protocols.weights.layout import DTYPES
from timeshare.runtime import SEMAPHORE_PREFIX, SHM_ROOT, mapped_anywhere
from timeshare.units import MIB

log = structlog.get_logger(__name__)
T = TypeVar("T")
IDLE_POLL_S = 0.05  # between SGLang's flush_cache tries while it finishes what it runs
PROGRESS_S = 0.5  # the heartbeat while a generate runs
# The shared memory SGLang's processes map, Python's named semaphores among it (which its
# resource tracker unlinks too, if it outlives them: runtime.py `end_groups`).
SEGMENT_PREFIXES = ("psm_", "sglang", "sgl_shm_mq_", SEMAPHORE_PREFIX)
# (sgl_shm_mq_: the message queues of its tensor-parallel ranks)
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # its CPU TP ranks' thread binding (cpu_binding.py)


def resolve_device(spec: SglangSpec) -> str:
    if spec.device != "auto":
        return spec.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def server_args(
    spec: SglangSpec, model_dir: str, device: str, *, dummy: bool, batch_invariant: bool = False
) -> dict[str, object]:
    """What `Engine(...)` gets: the typed keys, then server_args, then what timeshare sets
    (`batch_invariant`: [engine] batch_invariant, SGLang's deterministic inference)."""
    args: dict[str, object] = {**spec.typed_args(device), **spec.server_args}
    if batch_invariant:
        args["enable_deterministic_inference"] = True
    if dummy:
        args.setdefault("load_format", "dummy")  # the first SYNC brings the trainer's weights
    if device == "cpu":
        # SGLang's CPU engine: no overlap scheduler (it needs a device stream).
        args.setdefault("disable_overlap_schedule", True)
    args.update(
        model_path=model_dir,
        # Prompts are token ids; a multimodal model's processor (which expands each image or
        # video placeholder into its tokens) comes with its tokenizer.
        skip_tokenizer_init=not takes_media(model_dir),
        custom_weight_loader=[loader.NAME],
        enable_memory_saver=spec.release_memory and device == "cuda",
        log_level="error",
    )
    return args


def takes_media(model_dir: str) -> bool:
    """Whether SGLang runs the model of `model_dir` as a multimodal one (its architecture)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # SGLang itself says what is wrong with the directory
    from sglang.srt.configs.model_config import is_multimodal_model  # noqa: PLC0415

    return bool(is_multimodal_model(config.get("architectures") or []))


def build(context: EngineContext) -> SglangRollout:
    """The registry's builder (registry.py): SGLang serving the model the trainer trains."""
    trained = context.spec.served_model()
    return SglangRollout(
        context.rank,
        context.spec.settings("sglang", SglangSpec).starting_from(trained),
        trained.config,
        context.call_timeout_s,
        context.runtime_dir,
        batch_invariant=context.spec.batch_invariant,
    )


def start_engine(args: dict[str, object]) -> Any:  # SGLang's Engine (untyped)
    """SGLang's `Engine`, imported only now: SGLang reads its platform at import."""
    if args["device"] == "cpu":
        os.environ[CPU_ENGINE_ENV] = "1"
    from sglang.srt.entrypoints.engine import Engine  # noqa: PLC0415

    apply_patches([OWN_PROCESSES_ONLY])  # (own_shutdown.py)
    return Engine(**args)


class SglangRollout(ForeignRollout):
    """One rank's rollout engine over SGLang's `Engine`."""

    name = "SGLang"
    title_prefix = "sglang::"  # (not Python's resource tracker, the worker's own child)
    segment_prefixes = SEGMENT_PREFIXES

    def __init__(
        self,
        rank: int,
        spec: SglangSpec,
        trainer_model: ModelConfig,
        call_timeout_s: float,
        runtime_dir: Path,
        *,
        batch_invariant: bool = False,
    ) -> None:
        self.device = resolve_device(spec)
        super().__init__(
            rank,
            runtime_dir,
            call_timeout_s,
            spec.generate_timeout_s,
            # torch_memory_saver frees memory on CUDA only; elsewhere release/resume free nothing.
            releases=spec.release_memory and self.device == "cuda",
        )
        self.spec = spec
        self.model = trainer_model
        self._ids = itertools.count()
        model_dir = spec.model_dir or str(write_config_dir(trainer_model, self.scratch() / "model"))
        self.model_dir = model_dir
        args = server_args(
            spec, model_dir, self.device, dummy=not spec.model_dir, batch_invariant=batch_invariant
        )
        # SGLang's own handler of a child's SIGQUIT (sent as its scheduler or detokenizer fails)
        # SIGKILLs this whole process: the worker would die without a word of why.
        args["custom_sigquit_handler"] = self._sglang_failed
        self.binding = _cpu_binding(spec.tp_size) if self.device == "cpu" else {}
        if self.device == "cuda" and "base_gpu_id" not in spec.server_args:
            # gpu_placement.py: the engine for ranks rank.. runs on their devices.
            devices = group_devices(rank, spec.tp_size, torch.cuda.device_count())
            args["base_gpu_id"] = devices.start
        started = time.perf_counter()
        semaphores = _semaphores()
        try:
            # boot.py and plugin.py: SGLang's processes die with this one, and are patched;
            # cpu_binding.py: where TP ranks' threads run on a CPU.
            with self.starting(HOST_PID_ENV, self.binding):
                self.sgl = start_engine(args)
        except BaseException:
            self.remove_scratch()
            raise
        # A semaphore that a process of SGLang's start-up made and left (a multimodal model's
        # start leaves one), which nobody would ever unlink: made meanwhile, and mapped by no
        # process but SGLang's own (its maker may not have exited yet). One another process
        # maps is that process's.
        made = _semaphores() - semaphores
        ours = frozenset([os.getpid(), *self.own_processes()])
        self._orphans = sorted(made - mapped_anywhere(made, excluding=ours))
        self.media = MediaPlaceholders.of_model(self.sgl.tokenizer_manager.model_config)
        # SGLang takes a prompt of at most max_req_input_len tokens (its context_length less 6):
        # one more is what a prompt and a completion of at least one token may hold, always.
        self.max_tokens = int(self.sgl.tokenizer_manager.max_req_input_len) + 1
        self.record_processes()
        log.info(
            "sglang.started",
            rank=rank,
            seconds=round(time.perf_counter() - started, 1),
            device=self.device,
            releases_memory=self.releases,
            media=sorted(self.media.fields),
            tensor_parallel=spec.tp_size,
            **self.binding,
        )

    # -- calls into SGLang ----------------------------------------------------------------------

    def checked(self, what: str, fn: Callable[[], object]) -> None:
        """A call whose answer is SGLang's (success, message) pair or an output with them."""
        answer = self.call(what, fn)
        success, message = _success_of(answer)
        if not success:
            raise TimeshareError(f"SGLang rollout rank {self.rank}: {what} refused: {message}")

    def _sglang_failed(self, signum: int, frame: object) -> None:
        """SIGQUIT from one of SGLang's processes: it failed (its log says how). The engine is
        unusable; this raises in the worker's main thread, whatever it was waiting on."""
        gone = exited(self._titles)  # (a TP rank's scheduler killed: named)
        why = f"{', '.join(gone)} exited" if gone else "it sent SIGQUIT; see its log"
        self.broken = f"one of SGLang's processes failed ({why})"
        raise EngineBroken(f"{self.who}: {self.broken}")

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Until SGLang runs nothing: its cache flushes only when idle."""
        bound = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        while True:
            answer = self.call("flush_cache", self.sgl.flush_cache)
            if _success_of(answer)[0]:
                return
            if time.monotonic() > deadline:
                self.broken = f"not idle within {bound:g} s"
                raise EngineBroken(f"{self.who}: {self.broken}")
            time.sleep(IDLE_POLL_S)

    # -- weights --------------------------------------------------------------------------------

    def open_inlet(self, endpoint: str, transfer: TransferConfig) -> SglangInlet:
        return SglangInlet(self, endpoint, transfer)

    # -- memory ---------------------------------------------------------------------------------

    def sleep(self) -> None:
        if self.spec.release_memory:
            self.wait_idle()  # a release while SGLang still runs a request kills its scheduler
            self.checked(
                "release_memory_occupation",
                lambda: self.sgl.release_memory_occupation(tags=sorted(RELEASED)),
            )
            self.asleep = set(RELEASED)
        log.info(
            "rollout.sleep",
            rank=self.rank,
            engine="sglang",
            released=sorted(self.asleep) if self.releases else [],
            resident_mb=round(self.resident_mb(), 3),
            why=None
            if self.releases
            else "torch_memory_saver frees nothing on this platform: paused only",
        )

    def wake(self, tags: set[str]) -> None:
        waking = sorted(tags & self.asleep)
        if waking:
            self.checked(
                "resume_memory_occupation",
                lambda: self.sgl.resume_memory_occupation(tags=waking),
            )
            self.asleep -= set(waking)

    def _mb(self) -> float:
        return (self.weights_bytes + self._kv_bytes()) / MIB

    def _kv_bytes(self) -> int:
        """SGLang's KV cache: K and V of every layer for `max_total_tokens` tokens."""
        model = self.model
        element = torch.finfo(DTYPES.get(self.spec.dtype, torch.float32)).bits // 8
        per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
        return self.spec.max_total_tokens * per_token * element

    # -- generation -----------------------------------------------------------------------------

    def traits(self) -> RolloutTraits:
        """Images and videos where the model takes them (media.py); sleep frees memory only
        where torch_memory_saver can (CUDA); a sequence fits what SGLang takes (`max_tokens`)."""
        return RolloutTraits(
            inputs=self.media.fields, releases_memory=self.releases, max_tokens=self.max_tokens
        )

    def generate(self, requests: list[RolloutRequest]) -> list[RolloutSample]:
        version = self.check_whole()
        self.check_usable()
        traits = self.traits()
        for request in requests:
            refuse_unsupported(request, traits, "SGLang rollout")
            self.media.check_request(request)
        if not requests:
            return []
        batch = f"g{next(self._ids)}-r{self.rank}"
        rids = [f"{batch}-{index}" for index in range(len(requests))]
        arguments: dict[str, object] = {
            "input_ids": [list(request.prompt_tokens) for request in requests],
            "sampling_params": [
                _sampling(request, index) for index, request in enumerate(requests)
            ],
            "return_logprob": True,
            "rid": rids,
        }
        if any(request.images for request in requests):
            arguments["image_data"] = [list(request.images) for request in requests]
        if any(request.videos for request in requests):
            arguments["video_data"] = [list(request.videos) for request in requests]
        deadline = self.generate_deadline()
        outputs = self.sgl.loop.run_until_complete(self._generate(arguments, rids, deadline))
        if outputs is None:
            self.wait_idle()  # the aborted requests leave SGLang's scheduler
            raise GenerateTimeout(
                f"SGLang rollout rank {self.rank}: generate of {len(rids)} requests still "
                f"running after {self.generate_timeout_s:g} s (aborted)"
            )
        for request, output in zip(requests, outputs, strict=True):
            self.media.check_used(request, output)
        return [
            _sample(request, output, version)
            for request, output in zip(requests, outputs, strict=True)
        ]

    async def _generate(
        self, arguments: dict[str, object], rids: list[str], deadline: float
    ) -> list[dict[str, Any]] | None:
        """SGLang's generate, with the worker's heartbeat while it runs; past `deadline` its
        requests are aborted inside SGLang (None)."""
        task = asyncio.ensure_future(self.sgl.async_generate(**arguments))
        while not task.done():
            await asyncio.wait({task}, timeout=PROGRESS_S)
            self.progress()
            if not task.done() and time.monotonic() > deadline:
                task.cancel()
                for rid in rids:
                    self.sgl.tokenizer_manager.abort_request(rid=rid)
                await asyncio.wait({task}, timeout=self.call_timeout_s)
                return None
        outputs = task.result()
        return list(outputs) if isinstance(outputs, list) else [outputs]

    def shutdown_engine(self) -> None:
        # own_shutdown.py: SGLang's shutdown kills this engine's processes, and no other child
        # of this one; the shutdown SGLang registered for interpreter exit has nothing left to do.
        try:
            with ending(self.own_processes()):
                self.sgl.shutdown()
        finally:
            atexit.unregister(self.sgl.shutdown)


class SglangInlet:
    """The rollout worker's end of a SYNC into SGLang: one weight-update session per version,
    in which SGLang's scheduler runs timeshare's loader."""

    def __init__(self, engine: SglangRollout, endpoint: str, transfer: TransferConfig) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.transfer = transfer
        self.answer_path = str(engine.scratch() / "load-answer.msgpack")

    def receive(self, progress: Callable[[], None], *, digest: bool = True) -> TransferReport:
        engine = self.engine
        order = LoadOrder(
            endpoint=self.endpoint,
            transfer=self.transfer,
            begin_timeout_s=self.transfer.begin_timeout_s,
            digest=digest,
            answer_path=self.answer_path,
            model_dir=engine.model_dir,
            workers=engine.spec.tp_size,
        )
        engine.begin_weight_update()
        engine.checked("begin_weight_update", engine.sgl.begin_weight_update)
        try:
            engine.checked(
                "update_weights_from_tensor",
                lambda: engine.sgl.update_weights_from_tensor(
                    [(order.as_name(), torch.empty(0))], load_format=loader.NAME
                ),
            )
        finally:
            engine.checked("end_weight_update", engine.sgl.end_weight_update)
        progress()
        reports = self.read_answers(order)
        received = engine.loaded(reports)
        engine.mark_whole(received.transfer.version)
        # SGLang's scheduler is a process of this machine: its spans' clock is this one's.
        return received.transfer

    def read_answers(self, order: LoadOrder) -> list[LoadReport]:
        """Every TP rank's answer (each read once, all of them, whatever one says), checked;
        the first failure raised typed, naming the TP rank where there are several."""
        who = f"SGLang rollout rank {self.engine.rank}"
        outcomes = [_read_answer(order.answer_of(worker)) for worker in range(order.workers)]
        for worker, outcome in enumerate(outcomes):
            if isinstance(outcome, TimeshareError):
                raise outcome
            if outcome.report is None:
                where = who if order.workers == 1 else f"{who} TP worker {worker}"
                message = f"{where}: {outcome.error}"
                if outcome.failure == "loader":
                    raise LoaderFailed(message)
                raise TransferError(message)
        reports = [o.report for o in outcomes if isinstance(o, LoadOutcome) and o.report]
        return worker_reports_checked(reports, who)

    def close(self) -> None:
        """The receiver lives in SGLang's scheduler, until it exits (plugin.py)."""


def _read_answer(path: str) -> LoadOutcome | TimeshareError:
    try:
        return LoadOutcome.read(path)
    except TimeshareError as exc:
        return exc


def _cpu_binding(workers: int) -> dict[str, str]:
    """Where TP ranks' threads run on a CPU (cpu_binding.py). Without AMX SGLang binds no
    threads itself: each rank then gets as many threads as its group has cores."""
    cores = sorted(os.sched_getaffinity(0))
    binding = binding_environment(BIND_ENV, workers, cores, os.environ)
    if binding and "OMP_NUM_THREADS" not in os.environ:
        binding["OMP_NUM_THREADS"] = str(min(len(g) for g in core_groups(cores, workers)))
    return binding


def _semaphores() -> set[str]:
    return {path.name for path in SHM_ROOT.glob(f"{SEMAPHORE_PREFIX}*")}


def _success_of(answer: object) -> tuple[bool, str]:
    """SGLang answers (success, message), or an output object carrying them."""
    if isinstance(answer, tuple):
        return bool(answer[0]), str(answer[1])
    return bool(getattr(answer, "success", True)), str(getattr(answer, "message", ""))


def _sampling(request: RolloutRequest, index: int) -> dict[str, object]:
    """SGLang's sampling parameters for the `index`th request of a batch. `ignore_eos` stays
    False: SGLang's `ignore_eos` turns off the request's `stop_token_ids` too
    (schedule_batch.py `Req._check_token_based_finish`), and the model's EOS that SGLang would
    add besides is not checked (request_stops.py)."""
    sampling = request.sampling
    seed = secrets.randbits(63) if sampling.seed is None else mix(sampling.seed, index)
    return {
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "sampling_seed": seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": False,
    }


def _sample(request: RolloutRequest, output: dict[str, Any], version: int) -> RolloutSample:
    tokens = tuple(int(t) for t in output["output_ids"])
    meta = output["meta_info"]
    logprobs: tuple[float, ...] = ()
    if request.sampling.logprobs:
        logprobs = tuple(float(logprob) for logprob, _, _ in meta["output_token_logprobs"])
    return RolloutSample(
        request.request_id,
        tokens,
        logprobs,
        version,
        prompt_tokens=request.prompt_tokens,
        finish_reason=_finish_reason(request, tokens, meta.get("finish_reason")),
    )


def _finish_reason(request: RolloutRequest, tokens: tuple[int, ...], said: object) -> FinishReason:
    """How SGLang says the completion ended (its `finish_reason`, {"type": "stop" | "length" |
    "abort", ...}), checked against its tokens (SGLang keeps the token it stopped at; a stop at
    the model's EOS, were request_stops.py switched off, is refused)."""
    kind = said.get("type") if isinstance(said, dict) else said
    return checked_finish_reason("SGLang rollout", request, tokens, kind)
