"""The echo rollout engine: a `WeightLoader` receiving in its worker, a digit echoed back three
once, then the first of the request's stop tokens (the digit task's right answer)."""

from __future__ import annotations

import torch

from tests.engines.echo.spec import EchoSpec
from timeshare.engines.base import (
    RolloutEngine,
    RolloutRequest,
    RolloutSample,
    RolloutTraits,
    finish_reason,
    refuse_unsupported,
)
from timeshare.engines.context import EngineContext
from timeshare.engines.digest import weights_digest
from timeshare.engines.inlet import LocalInlet
from timeshare.protocols.weights import TransferConfig
from timeshare.task.vocab import ANSWER_DIGITS

ECHOED = ANSWER_DIGITS  # times the prompt's digit is said back


def build(context: EngineContext) -> EchoRollout:
    return EchoRollout(context.spec.settings("echo", EchoSpec))


class EchoRollout(RolloutEngine):
    def __init__(self, spec: EchoSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weights: dict[str, torch.Tensor] = {}

    def open_inlet(self, endpoint: str, transfer: TransferConfig) -> LocalInlet:
        return LocalInlet(self, endpoint, transfer)

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.weights.update((name, tensor.clone()) for name, tensor in named)

    def finish_weight_update(self, version: int) -> None:
        """Nothing to post-process (the inlet marks the version whole)."""

    def digest(self) -> str:
        return weights_digest(self.weights.items())

    def traits(self) -> RolloutTraits:
        return RolloutTraits(max_tokens=self.spec.max_tokens)

    def generate(self, requests: list[RolloutRequest]) -> list[RolloutSample]:
        version = self.check_whole()
        for request in requests:
            refuse_unsupported(request, self.traits(), "echo rollout")
        return [self._echo(request, version) for request in requests]

    def _echo(self, request: RolloutRequest, version: int) -> RolloutSample:
        stops = request.sampling.stop_token_ids
        answer = (request.prompt_tokens[1],) * ECHOED + stops[:1]
        tokens = answer[: request.sampling.max_tokens]
        logprobs = (self.spec.logprob,) * len(tokens)
        return RolloutSample(
            request.request_id,
            tokens,
            logprobs,
            version,
            request.prompt_tokens,
            finish_reason=finish_reason(tokens, stops),
        )

    def sleep(self) -> None:
        pass

    def wake(self, tags: set[str]) -> None:
        pass

    def held_mb(self) -> float:
        return 0.0
