"""The reference rollout engine: its own copy of the model, a KV cache, seeded sampling.

`wake({"weights"})` allocates the parameters (uninitialised: the next SYNC fills them),
`wake({"kv_cache"})` allocates the cache for `batch_size` sequences of `kv_cache_len` tokens,
`sleep()` frees both. Generation refuses torn weights (no whole transfer since the last began)
and a sleeping cache. Logprobs are those of softmax(logits / temperature), before top-p, which
is what the trainer recomputes.
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
    refuse_unsupported,
)
from timeshare.engines.context import EngineContext
from timeshare.engines.digest import weights_digest
from timeshare.engines.grpo import token_logprobs
from timeshare.engines.inlet import LocalInlet
from timeshare.engines.invariance import enable_strict_gemm
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.spec import EngineChoice
from timeshare.engines.torch_ref.model import CausalLM, KVCache
from timeshare.engines.torch_ref.spec import TorchRefSpec
from timeshare.errors import EngineAsleep, LoaderFailed, TimeshareError
from timeshare.protocols.weights import TransferConfig
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
        if self.model is None:
            raise EngineAsleep("digest: the weights are asleep")
        return weights_digest((name, p.detach()) for name, p in self.model.named_parameters())

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
        lengths = {len(r.prompt_tokens) for r in requests}
        total = max(lengths) + sampling.max_tokens
        if len(lengths) != 1:
            raise TimeshareError(
                f"torch_ref rollout: prompts of differing lengths {sorted(lengths)}"
            )
        if len(requests) > self.batch_size or total > self.spec.kv_cache_len:
            raise TimeshareError(
                f"torch_ref rollout: {len(requests)} sequences of {total} tokens exceed the KV "
                f"cache ({self.batch_size} x {self.spec.kv_cache_len})"
            )
        tokens, logprobs = self._sample(
            requests, sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed
        )
        return [
            RolloutSample(
                request.request_id,
                tuple(tokens[i]),
                tuple(logprobs[i]),
                version,
                prompt_tokens=request.prompt_tokens,
            )
            for i, request in enumerate(requests)
        ]

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
        shapes = {(len(s.prompt_tokens), len(s.tokens)) for s in samples}
        (prompt_len, completion_len), *others = sorted(shapes)
        if others or len(samples) > self.batch_size or completion_len == 0:
            raise TimeshareError(
                f"torch_ref rollout: score takes up to {self.batch_size} samples of one prompt "
                f"and completion length, not {len(samples)} of {sorted(shapes)}"
            )
        if prompt_len + completion_len > self.spec.kv_cache_len:
            raise TimeshareError(
                f"torch_ref rollout: {prompt_len + completion_len} tokens exceed the KV cache "
                f"({self.spec.kv_cache_len})"
            )
        completions = torch.tensor([s.tokens for s in samples], dtype=torch.long)
        logprobs = []
        with torch.no_grad():
            logits = self._prefill(torch.tensor([s.prompt_tokens for s in samples]))
            for position in range(completion_len):
                token = completions[:, position]
                logprobs.append(token_logprobs(logits, token, temperature))
                if position + 1 < completion_len:
                    logits = self._decode(token)
        return [tuple(row) for row in torch.stack(logprobs, dim=1).tolist()]

    def _prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """The next token's logits after `prompts` [batch, len], the cache emptied first."""
        assert self.model is not None and self.cache is not None
        self.cache.length = 0
        logits: torch.Tensor = self.model(prompts, self.cache)[:, -1]
        return logits

    def _decode(self, token: torch.Tensor) -> torch.Tensor:
        """The next token's logits after one more token per sequence, `token` [batch]."""
        assert self.model is not None and self.cache is not None
        logits: torch.Tensor = self.model(token.unsqueeze(1), self.cache)[:, -1]
        return logits

    def _sample(
        self,
        requests: list[RolloutRequest],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        assert self.model is not None and self.cache is not None
        deadline = self.generate_deadline()
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
        prompts = torch.tensor([r.prompt_tokens for r in requests], dtype=torch.long)
        chosen: list[torch.Tensor] = []
        chosen_logprobs: list[torch.Tensor] = []
        with torch.no_grad():
            logits = self._prefill(prompts)
            for position in range(max_tokens):
                token = _sample_top_p(logits / temperature, top_p, generator)
                chosen.append(token)
                chosen_logprobs.append(token_logprobs(logits, token, temperature))
                self.progress()
                self.check_deadline(deadline, len(requests))
                if position + 1 < max_tokens:
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
