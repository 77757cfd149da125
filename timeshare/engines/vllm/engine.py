"""The vLLM rollout engine: vLLM's `LLM` inside the rollout worker process of one rank.

The worker process makes the `LLM`; vLLM starts `VLLM::EngineCore`, which starts the
`VLLM::Worker` that holds the model. Weights arrive in that worker, through timeshare's backend
(backend.py): `VllmInlet` drives it with `LLM`'s weight-transfer methods, every call bounded by
the phase deadline (a call past it leaves the engine unusable, and says so).

Generation runs vLLM's engine loop here, one step at a time, so that a generate past its
deadline is aborted inside vLLM and the engine stays usable. Each request gets its own seed
(the batch's seed and its index), logprobs are those of the sampled distribution
(`logprobs_mode="processed_logprobs"`, after temperature and top-p), and every sample carries the
weight version that produced it. A completion stops at the first of its request's stop tokens
(kept, with its logprob) and at no other: `ignore_eos` keeps vLLM from adding the EOS of the
model's generation config to the request's own (see `_sampling`).

Memory: where vLLM has sleep mode (CUDA), `sleep()` is `LLM.sleep(level)` and `wake(tags)` the
staged `LLM.wake_up(tags)`. Where it has not (CPU), `sleep()` only stops scheduling (nothing is
scheduled between rollouts) and the engine says so: it can release nothing, so `held_mb` is 0 and
what it keeps is `resident_mb`, which the log and the summary show.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import torch

from timeshare.engines.base import (
    RolloutRequest,
    RolloutSample,
    RolloutTraits,
    checked_finish_reason,
    refuse_unsupported,
)
from timeshare.engines.context import EngineContext
from timeshare.engines.cpu_binding import binding_environment
from timeshare.engines.foreign import ForeignRollout
from timeshare.engines.gpu_placement import visible_environment
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.model_dir import write_config_dir
from timeshare.engines.task import mix
from timeshare.engines.vllm.plugin import BACKEND, HOST_PID_ENV
from timeshare.engines.vllm.report import LOADER_REFUSED, worker_reports
from timeshare.engines.vllm.spec import BATCH_INVARIANT_ENV, VllmSpec
from timeshare.errors import (
    GenerateTimeout,
    LoaderFailed,
    TransferError,
)
from timeshare.protocols.weights import TransferConfig, TransferReport
from timeshare.runtime import SEMAPHORE_PREFIX
from timeshare.units import MIB
from vllm import LLM
from vllm import SamplingParams as VllmSampling
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm.logprobs import LogprobsOnePosition
    from vllm.v1.engine.llm_engine import LLMEngine

log = structlog.get_logger(__name__)
EXTENSION = "timeshare.engines.vllm.backend.TimeshareWorkerExtension"
EXTENSION_REPORT = "timeshare_report"  # its method that returns the last version's report
EXTENSION_STEP = "timeshare_step"  # its method that runs one weight-transfer step
EXTENSION_INVARIANT = "timeshare_batch_invariant"  # whether a worker runs batch-invariant
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # its CPU workers' thread binding (cpu_binding.py)
# The shared memory vLLM's processes map: Python's SharedMemory (its message queues), its CPU
# TP workers' all-reduce buffers (vllm_dist_*-cpushm_<rank>, which a SIGKILLed worker leaves),
# Python's named semaphores (which its resource tracker unlinks too, if it outlives them:
# runtime.py `end_groups`).
VLLM_SEGMENT_PREFIXES = ("psm_", "vllm_dist_", SEMAPHORE_PREFIX)


def engine_args(spec: VllmSpec, model_dir: str, *, sleep_mode: bool) -> dict[str, Any]:
    """What `LLM(...)` gets: the typed keys, then engine_args, then what timeshare sets itself."""
    args: dict[str, Any] = {**spec.typed_args(), **spec.engine_args}
    if not spec.model_dir:
        args.setdefault("load_format", "dummy")  # the first SYNC brings the trainer's weights
    args.update(
        model=model_dir,
        skip_tokenizer_init=True,
        weight_transfer_config={"backend": BACKEND},
        worker_extension_cls=EXTENSION,
        logprobs_mode="processed_logprobs",
        enable_sleep_mode=sleep_mode,
    )
    return args


def build(context: EngineContext) -> VllmRollout:
    """The registry's builder (registry.py): vLLM serving the model the trainer trains."""
    trained = context.spec.served_model()
    return VllmRollout(
        context.rank,
        context.spec.settings("vllm", VllmSpec).starting_from(trained),
        trained.config,
        context.call_timeout_s,
        context.runtime_dir,
        batch_invariant=context.spec.batch_invariant,
    )


class VllmRollout(ForeignRollout):
    """One rank's rollout engine over vLLM's `LLM`."""

    name = "vLLM"
    title_prefix = "VLLM::"
    segment_prefixes = VLLM_SEGMENT_PREFIXES

    def __init__(
        self,
        rank: int,
        spec: VllmSpec,
        trainer_model: ModelConfig,
        call_timeout_s: float,
        runtime_dir: Path,
        *,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__(
            rank,
            runtime_dir,
            call_timeout_s,
            spec.generate_timeout_s,
            releases=current_platform.is_sleep_mode_available(),
        )
        self.spec = spec
        self._ids = itertools.count()
        model_dir = spec.model_dir or str(write_config_dir(trainer_model, self.scratch()))
        self.binding = _placement(rank, spec.tensor_parallel_size)
        # [engine] batch_invariant, to the engine's own processes (its probe refused it where
        # the platform has no such mode)
        invariance = {BATCH_INVARIANT_ENV: "1"} if batch_invariant else {}
        started = time.perf_counter()
        try:
            # plugin.py: vLLM's processes die with this one; cpu_binding.py and
            # gpu_placement.py: where its TP workers run.
            with self.starting(HOST_PID_ENV, {**self.binding, **invariance}):
                self.llm = LLM(**engine_args(spec, model_dir, sleep_mode=self.releases))
        except BaseException:
            self.remove_scratch()
            raise
        self.record_processes()
        log.info(
            "vllm.started",
            rank=rank,
            seconds=round(time.perf_counter() - started, 1),
            sleep_mode=self.releases,
            tensor_parallel=spec.tensor_parallel_size,
            **self.binding,
        )

    def batch_invariant_workers(self) -> list[bool]:
        """Whether each of vLLM's workers runs its batch-invariant kernels, as it says."""
        llm = self.llm
        answers = self.call("batch_invariant", lambda: llm.collective_rpc(EXTENSION_INVARIANT))
        return [bool(answer) for answer in answers]

    # -- weights --------------------------------------------------------------------------------

    def open_inlet(self, endpoint: str, transfer: TransferConfig) -> VllmInlet:
        return VllmInlet(self, endpoint, transfer)

    # -- memory ---------------------------------------------------------------------------------

    def sleep(self) -> None:
        if self.releases:
            self.call("sleep", lambda: self.llm.sleep(level=self.spec.sleep_level))
            self.asleep = {"weights", "kv_cache"}
            if self.spec.sleep_level == 2:
                self.torn = True  # level 2 discards the weights: only a transfer brings them
        log.info(
            "rollout.sleep",
            rank=self.rank,
            engine="vllm",
            released=sorted(self.asleep),
            resident_mb=round(self.resident_mb(), 3),
            why=None if self.releases else "vLLM has no sleep mode on this platform: paused only",
        )

    def wake(self, tags: set[str]) -> None:
        waking = sorted(tags & self.asleep)
        if waking:
            self.call("wake_up", lambda: self.llm.wake_up(tags=waking))
            self.asleep -= set(waking)

    def _mb(self) -> float:
        # The weights once across the TP workers (each holds its shard), a KV cache each.
        kv = (self.spec.kv_cache_mb or 0.0) * self.spec.tensor_parallel_size
        return self.weights_bytes / MIB + kv

    # -- generation -----------------------------------------------------------------------------

    def traits(self) -> RolloutTraits:
        """A text model; sleep frees memory only where vLLM has sleep mode (CUDA); a sequence
        fits `max_model_len`."""
        return RolloutTraits(releases_memory=self.releases, max_tokens=self.spec.max_model_len)

    def generate(self, requests: list[RolloutRequest]) -> list[RolloutSample]:
        version = self.check_whole()
        self.check_usable()
        for request in requests:
            refuse_unsupported(request, self.traits(), "vLLM rollout")
        engine = self.llm.llm_engine
        batch = f"g{next(self._ids)}"
        pending: dict[str, int] = {}
        for index, request in enumerate(requests):
            request_id = f"{batch}-{index}"
            engine.add_request(request_id, _prompt(request), _sampling(request, index))
            pending[request_id] = index
        outputs: dict[int, RequestOutput] = {}
        deadline = self.generate_deadline()
        try:
            self._step_until_done(engine, pending, outputs, deadline, len(requests))
        except Exception as exc:
            self.raise_if_process_gone("generate", exc)
            raise
        finally:
            if pending and self.broken is None:
                engine.abort_request(list(pending))
        return [_sample(request, outputs[index], version) for index, request in enumerate(requests)]

    def _step_until_done(
        self,
        engine: LLMEngine,
        pending: dict[str, int],
        outputs: dict[int, RequestOutput],
        deadline: float,
        requests: int,
    ) -> None:
        """Step vLLM's engine until every pending request finished, or the deadline passed."""
        while pending:
            if time.monotonic() > deadline:
                raise GenerateTimeout(
                    f"vLLM rollout rank {self.rank}: generate of {requests} requests "
                    f"still running after {self.generate_timeout_s:g} s "
                    f"({len(pending)} unfinished, aborted)"
                )
            for output in engine.step():
                done = pending.get(output.request_id)
                if done is not None and output.finished:
                    if not isinstance(output, RequestOutput):  # a pooling model's: not asked
                        raise TypeError(f"vLLM answered a generate with a {type(output).__name__}")
                    outputs[done] = output
                    del pending[output.request_id]
            self.progress()

    def shutdown_engine(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _placement(leader: int, workers: int) -> dict[str, str]:
    """Where the TP workers of the engine for ranks leader.. run: their threads' cores on a CPU
    (cpu_binding.py), their group's GPUs on CUDA (gpu_placement.py)."""
    if current_platform.is_cpu():
        cores = sorted(os.sched_getaffinity(0))
        return binding_environment(BIND_ENV, workers, cores, os.environ)
    if current_platform.is_cuda():
        return visible_environment(leader, workers, torch.cuda.device_count(), os.environ)
    return {}


class VllmInlet:
    """The rollout worker's end of a SYNC into vLLM: drives the backend in every vLLM worker.

    Each weight-transfer step runs in every worker through the worker extension's
    `timeshare_step` (backend.py), which answers what the step raised instead of raising it.
    vLLM's own calls (`LLM.update_weights`, ...) stop reading the workers' answers at the
    first one that failed and leave the others queued: with tensor parallelism every later
    call would then read the answer of the call before it. Here every worker answers every
    call, and every answer is read.
    """

    def __init__(self, engine: VllmRollout, endpoint: str, transfer: TransferConfig) -> None:
        self.engine = engine
        self.transfer = transfer
        init_info = {"endpoint": endpoint, "transfer": msgspec.to_builtins(transfer)}
        self._step("init_weight_transfer_engine", {"init_info": init_info})

    def receive(self, progress: Callable[[], None], *, digest: bool = True) -> TransferReport:
        llm = self.engine.llm
        update = {"begin_timeout_s": self.transfer.begin_timeout_s, "digest": digest}
        self._step("start_weight_update")
        self._step("update_weights", {"update_info": update})
        progress()
        answers = self.engine.call("timeshare_report", lambda: llm.collective_rpc(EXTENSION_REPORT))
        reports = worker_reports(answers, self.engine.rank, self.engine.spec.tensor_parallel_size)
        version = reports[0].transfer.version
        self._step("finish_weight_update")
        llm.llm_engine.set_weight_version(str(version))
        received = self.engine.loaded(reports)
        self.engine.mark_whole(version)
        # vLLM's worker is a process of this machine: its spans' monotonic clock is this one's.
        return received.transfer

    def _step(self, step: str, arguments: dict[str, object] | None = None) -> None:
        """One weight-transfer step in every vLLM worker; what any of them raised (its text:
        all that crosses vLLM's RPC) is raised here typed again, naming the TP worker."""
        llm = self.engine.llm
        answers = self.engine.call(
            step, lambda: llm.collective_rpc(EXTENSION_STEP, args=(step, arguments or {}))
        )
        failed = [(worker, answer) for worker, answer in enumerate(answers) if answer is not None]
        if failed:
            raise _transfer_failed(self.engine.rank, step, failed, len(answers))

    def close(self) -> None:
        if self.engine.broken is None:
            self._step("shutdown_weight_transfer_engine")


def _transfer_failed(
    rank: int, step: str, failed: list[tuple[int, object]], workers: int
) -> TransferError | LoaderFailed:
    """What the backend raised in a weight-transfer step, typed again from its text: the
    model's loader refusing a weight, or the transfer failing."""
    said = [f"{'' if workers == 1 else f'TP worker {worker}: '}{text}" for worker, text in failed]
    message = f"vLLM rollout rank {rank}: {step} failed: {'; '.join(said)}"
    return LoaderFailed(message) if LOADER_REFUSED in message else TransferError(message)


def _prompt(request: RolloutRequest) -> TokensPrompt:
    return TokensPrompt(prompt_token_ids=list(request.prompt_tokens))


def _sampling(request: RolloutRequest, index: int) -> VllmSampling:
    """vLLM's sampling parameters for the `index`th request of a batch.

    The request's stop set is the only one. vLLM 0.32 stops at `stop_token_ids` whatever
    `ignore_eos` says (v1/core/sched/utils.py `check_stop`); what `ignore_eos=False` would add
    is the tokenizer's EOS (None here: `skip_tokenizer_init`) and the model's generation-config
    EOS, merged into `stop_token_ids` (sampling_params.py `update_from_generation_config`).
    So `ignore_eos=True`, which is right only because the job's stop set always holds the
    model's EOS: task/files.py `generation_eos` reads it from generation_config.json, or from
    config.json where vLLM builds its generation config from that, and the workload sends the
    set in every request. A request without it (a test's) means it."""
    sampling = request.sampling
    seed = None if sampling.seed is None else mix(sampling.seed, index)
    return VllmSampling(
        n=1,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        logprobs=0 if sampling.logprobs else None,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=True,
        detokenize=False,
    )


def _sample(request: RolloutRequest, output: RequestOutput, version: int) -> RolloutSample:
    completion = output.outputs[0]
    tokens = tuple(int(t) for t in completion.token_ids)
    logprobs: tuple[float, ...] = ()
    if completion.logprobs is not None:
        logprobs = tuple(
            _logprob(step, token) for step, token in zip(completion.logprobs, tokens, strict=True)
        )
    return RolloutSample(
        request.request_id,
        tokens,
        logprobs,
        version,
        prompt_tokens=request.prompt_tokens,
        finish_reason=checked_finish_reason(
            "vLLM rollout", request, tokens, completion.finish_reason
        ),
    )


def _logprob(step: LogprobsOnePosition | None, token: int) -> float:
    """The sampled token's logprob at one position. vLLM types a sample's positions as
    optional (FlatLogprobs is a sequence of `dict | None`); a sampled position always has one,
    and a missing one is the TypeError indexing None would have raised, naming the token."""
    if step is None:
        raise TypeError(f"vLLM gave no logprobs at the position of sampled token {token}")
    return float(step[token].logprob)
