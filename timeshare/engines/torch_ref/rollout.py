"""The reference rollout engine: its own copy of the model, a KV cache, seeded sampling.

`wake({"weights"})` allocates the parameters (uninitialised: the next SYNC fills them),
`wake({"kv_cache"})` allocates the cache for `batch_size` sequences of `kv_cache_len` tokens,
`sleep()` frees both. Generation refuses torn weights (no whole transfer since the last began)
and a sleeping cache. Logprobs are those of softmax(logits / temperature), before top-p, which
is what the trainer recomputes. Prompts of a batch may differ in length (each row decodes at its
own position: model.py); a row ends at its first stop token, kept, and the batch ends when every
row has.
"""

from __future__ import annotations

import structlog
import torch

from timeshare.engines.base import (
    DEFAULT_GENERATE_S,
    RolloutEngine,
    RolloutRequest,
    RolloutSample,
    RolloutTraits,
    SamplingParams,
    finish_reason,
    refuse_unsupported,
    until_stop,
)
from timeshare.engines.context import EngineContext
from timeshare.engines.digest import WeightsDigest, digest_of
from timeshare.engines.inlet import LocalInlet
from timeshare.engines.invariance import enable_strict_gemm
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.sequences import PAD, pack, unpadded
from timeshare.engines.spec import EngineChoice
from timeshare.engines.torch_ref.model import CausalLM, KVCache
from timeshare.engines.torch_ref.spec import TorchRefSpec
from timeshare.errors import EngineAsleep, LoaderFailed, TimeshareError
from timeshare.protocols.weights import TransferConfig
from timeshare.task.grpo_math import token_logprobs
from timeshare.units import MIB

log = structlog.get_logger(__name__)


def build(context: EngineContext) -> TorchRefRollout:
    """The registry's builder (registry.py): a copy of the model the trainer trains."""
    trained = context.spec.served_model()
    rollout = TorchRefRollout(context.rank, context.spec, trained.config)
    rollout.generate_timeout_s = rollout.spec.generate_timeout_s or context.generate_timeout_s
    return rollout


class TorchRefRollout(RolloutEngine):
    def __init__(self, rank: int, engine: EngineChoice, model_config: ModelConfig) -> None:
        self.spec = engine.settings("torch_ref", TorchRefSpec)
        super().__init__(self.spec.generate_timeout_s or DEFAULT_GENERATE_S)
        self.rank = rank
        self.batch_size = engine.task.batch_size
        self.config = model_config
        self.batch_invariant = engine.batch_invariant
        if self.batch_invariant:
            enable_strict_gemm()  # before the first GEMM of this process
        self.model: CausalLM | None = None
        self.cache: KVCache | None = None
        self.loaded: set[str] = set()

    # -- memory --------------------------------------------------------------------------------

    def wake(self, tags: set[str]) -> None:
        if "weights" in tags and self.model is None:
            with torch.device("meta"):
                skeleton = CausalLM(self.config)
            self.model = skeleton.to_empty(device="cpu").eval()
            self.model.set_batch_invariant(self.batch_invariant)
            self.loaded.clear()
            log.info("rollout.wake", rank=self.rank, tag="weights", mb=round(self.weights_mb, 3))
        if "kv_cache" in tags and self.cache is None:
            if self.model is None:
                raise EngineAsleep("wake kv_cache: the weights are asleep (wake them first)")
            self.cache = KVCache(self.config, self.batch_size, self.spec.kv_cache_len)
            log.info("rollout.wake", rank=self.rank, tag="kv_cache", mb=self.cache.nbytes / MIB)

    def sleep(self) -> None:
        freed = self.weights_mb + (self.cache.nbytes / MIB if self.cache else 0.0)
        self.model = None
        self.cache = None
        self.torn = True  # the weights are gone: only a whole transfer brings them back
        log.info("rollout.sleep", rank=self.rank, freed_mb=round(freed, 3))

    @property
    def weights_mb(self) -> float:
        if self.model is None:
            return 0.0
        return sum(p.nbytes for p in self.model.parameters()) / MIB

    def held_mb(self) -> float:
        return self.weights_mb + (self.cache.nbytes / MIB if self.cache else 0.0)

    # -- weights -------------------------------------------------------------------------------

    def open_inlet(self, endpoint: str, transfer: TransferConfig) -> LocalInlet:
        return LocalInlet(self, endpoint, transfer)

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if self.model is None:
            raise EngineAsleep("load_weights: the weights are asleep (wake them first)")
        parameters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                if name not in parameters:
                    raise LoaderFailed(f"torch_ref rollout: the model has no parameter {name!r}")
                target = parameters[name]
                if target.shape != tensor.shape or target.dtype != tensor.dtype:
                    raise LoaderFailed(
                        f"torch_ref rollout: {name} is {tuple(tensor.shape)} {tensor.dtype}, the "
                        f"model expects {tuple(target.shape)} {target.dtype}"
                    )
                target.copy_(tensor)
                self.loaded.add(name)

    def finish_weight_update(self, version: int) -> None:
        if self.model is None:
            raise EngineAsleep("finish_weight_update: the weights are asleep")
        missing = {name for name, _ in self.model.named_parameters()} - self.loaded
        if missing:
            raise TimeshareError(f"weight update {version} left {sorted(missing)} unloaded")

    def digest(self) -> str:
        return self._digest().hexdigest()

    def table(self) -> dict[str, str]:
        return self._digest().table()

    def _digest(self) -> WeightsDigest:
        if self.model is None:
            raise EngineAsleep("digest: the weights are asleep")
        return digest_of((name, p.detach()) for name, p in self.model.named_parameters())

    # -- generation ----------------------------------------------------------------------------

    def traits(self) -> RolloutTraits:
        """Text only; sleep frees weights and cache; a sequence fits the KV cache."""
        return RolloutTraits(max_tokens=self.spec.kv_cache_len)

    def generate(self, requests: list[RolloutRequest]) -> list[RolloutSample]:
        version = self.check_whole()
        if self.model is None or self.cache is None:
            raise EngineAsleep("generate: wake weights and kv_cache first")
        if not requests:
            return []
        for request in requests:
            refuse_unsupported(request, self.traits(), "torch_ref rollout")
        sampling = requests[0].sampling
        if any(r.sampling != sampling for r in requests):
            raise TimeshareError("torch_ref rollout: one batch must share its sampling parameters")
        self._check_fits(
            len(requests), max(len(r.prompt_tokens) for r in requests) + sampling.max_tokens
        )
        tokens, logprobs = self._sample([r.prompt_tokens for r in requests], sampling)
        samples = []
        for request, row_tokens, row_logprobs in zip(requests, tokens, logprobs, strict=True):
            kept = until_stop(row_tokens, sampling.stop_token_ids)
            completion = tuple(row_tokens[:kept])
            samples.append(
                RolloutSample(
                    request.request_id,
                    completion,
                    tuple(row_logprobs[:kept]),
                    version,
                    prompt_tokens=request.prompt_tokens,
                    finish_reason=finish_reason(completion, sampling.stop_token_ids),
                )
            )
        return samples

    def score(self, samples: list[RolloutSample], temperature: float) -> list[tuple[float, ...]]:
        """The logprobs of each sample's completion under the loaded weights, computed as
        `generate` computes them (its prompt in one prefill, then a token at a time): in the
        batch-invariant mode, a sample's numbers alone or beside others are those it was
        sampled with."""
        self.check_whole()
        if self.model is None or self.cache is None:
            raise EngineAsleep("score: wake weights and kv_cache first")
        if not samples:
            return []
        if any(not s.tokens for s in samples):
            raise TimeshareError("torch_ref rollout: score takes samples with a completion")
        longest = max(len(s.prompt_tokens) + len(s.tokens) for s in samples)
        self._check_fits(len(samples), longest)
        sequences = pack(samples)
        completions = sequences.completions
        logprobs = []
        with torch.no_grad():
            logits = self._prefill([s.prompt_tokens for s in samples])
            for position in range(completions.shape[1]):
                token = completions[:, position]
                logprobs.append(token_logprobs(logits, token, temperature))
                if position + 1 < completions.shape[1]:
                    logits = self._decode(token)
        return unpadded(torch.stack(logprobs, dim=1), sequences)

    def _check_fits(self, rows: int, tokens: int) -> None:
        """`rows` sequences of up to `tokens` tokens fit the KV cache."""
        if rows > self.batch_size or tokens > self.spec.kv_cache_len:
            raise TimeshareError(
                f"torch_ref rollout: {rows} sequences of {tokens} tokens exceed the KV "
                f"cache ({self.batch_size} x {self.spec.kv_cache_len})"
            )

    def _prefill(self, prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """The next token's logits after each of `prompts` (of any lengths), in the cache."""
        assert self.model is not None and self.cache is not None
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        padded = torch.full((len(prompts), int(lengths.max())), PAD, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            padded[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        return self.model.prefill(padded, lengths, self.cache)

    def _decode(self, token: torch.Tensor) -> torch.Tensor:
        """The next token's logits after one more token per sequence, `token` [batch]."""
        assert self.model is not None and self.cache is not None
        return self.model.decode(token, self.cache)

    def _sample(
        self, prompts: list[tuple[int, ...]], sampling: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Up to `max_tokens` tokens after each prompt, and their logprobs; every row goes on
        until every row has sampled a stop token (what a row samples after its own is cut by
        the caller), so that a row's draws do not depend on when the others stop."""
        assert self.model is not None and self.cache is not None
        deadline = self.generate_deadline()
        generator = torch.Generator()
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long)
        done = torch.zeros(len(prompts), dtype=torch.bool)
        chosen: list[torch.Tensor] = []
        chosen_logprobs: list[torch.Tensor] = []
        with torch.no_grad():
            logits = self._prefill(prompts)
            for position in range(sampling.max_tokens):
                if sampling.temperature == 0.0:  # greedy (validation): logprobs at 1
                    token = logits.argmax(dim=-1)
                else:
                    scaled = logits / sampling.temperature
                    token = _sample_top_p(scaled, sampling.top_p, generator)
                chosen.append(token)
                chosen_logprobs.append(token_logprobs(logits, token, sampling.temperature or 1.0))
                done |= torch.isin(token, stops)
                self.progress()
                self.check_deadline(deadline, len(prompts))
                if bool(done.all()) or position + 1 == sampling.max_tokens:
                    break
                logits = self._decode(token)
        return (
            torch.stack(chosen, dim=1).tolist(),
            torch.stack(chosen_logprobs, dim=1).tolist(),
        )


def _sample_top_p(scaled: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(scaled), keeping the smallest set of mass >= top_p."""
    probs = torch.softmax(scaled.float(), dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = ordered.cumsum(dim=-1) - ordered > top_p
        ordered = ordered.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
