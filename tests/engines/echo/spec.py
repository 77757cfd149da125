"""`[engine.echo]`: the echo engine's settings (torch-free, as every spec module is)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec

from timeshare.errors import ConfigError

if TYPE_CHECKING:
    from timeshare.engines.registry import Role
    from timeshare.engines.spec import EngineChoice


class EchoSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 32  # prompt + completion it holds
    logprob: float = -0.5  # what it reports for every sampled token


def check(spec: EngineChoice, roles: frozenset[Role]) -> None:
    echo = spec.settings("echo", EchoSpec)
    if spec.task.sequence_tokens > echo.max_tokens:
        raise ConfigError(
            f"engine.echo.max_tokens ({echo.max_tokens}) is shorter than a prompt and its "
            f"completion ({spec.task.sequence_tokens})"
        )
