"""A rollout engine added the way a contributor adds one: this package and one registry entry
(test_registry.py adds the entry), nothing else in the tree. It serves the task by echoing the
prompt's digit, with the weights it received through the real channel."""

from timeshare.engines.registry import EngineEntry

# What a contributor adds to `ENGINES` in timeshare/engines/registry.py.
ENTRY = EngineEntry(
    spec="tests.engines.echo.spec:EchoSpec",
    family="causal_lm",
    summary="echoes the prompt's digit (a test's engine)",
    rollout="tests.engines.echo.engine:build",
    check="tests.engines.echo.spec:check",
)
