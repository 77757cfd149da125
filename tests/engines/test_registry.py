"""The engine registry: every entry's parts exist, and a new engine is its package plus one entry.

The echo engine (tests/engines/echo/) is added here the way a contributor adds one: its package
and one `EngineEntry`. Nothing else changes, yet the config types and checks its table, the
command line lists it, and a rank's pair built through the registry syncs real weights into it
and trains on what it generates.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from tests.engines import echo
from timeshare.engines import registry
from timeshare.engines import spec as engine_spec_module
from timeshare.engines.context import EngineContext
from timeshare.engines.digest import weights_digest
from timeshare.engines.pairs import build_rollout, build_trainer, workload_of
from timeshare.engines.spec import EngineChoice, check_engines
from timeshare.errors import ConfigError
from timeshare.protocols.store import JobStore
from timeshare.protocols.weights import TransferConfig, WeightSender

ROOT = Path(__file__).resolve().parents[2]
ECHO = echo.ENTRY
JOB = {
    "trainer": "torch_ref",
    "rollout": "echo",
    "task": {"prompts_per_rank": 2, "group_size": 4, "max_completion_tokens": 4},
    "echo": {"logprob": -0.25},
}


def defined_names(target: str) -> tuple[Path, set[str]]:
    """The file `module:name` lives in and the top-level names it defines (read, not imported:
    importing vLLM's builder would take seconds)."""
    module = target.partition(":")[0]
    found = importlib.util.find_spec(module)
    assert found is not None and found.origin is not None, f"{target}: no module {module}"
    path = Path(found.origin)
    tree = ast.parse(path.read_text())
    names = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }
    names |= {  # a builder may be a name bound to a class's constructor (`build = X.from_...`)
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return path, names


@pytest.mark.parametrize("name", list(registry.ENGINES))
def test_every_entry_names_parts_that_exist(name: str) -> None:
    entry = registry.ENGINES[name]
    assert entry.roles(), f"{name} is neither a trainer nor a rollout engine"
    for target in (entry.spec, entry.trainer, entry.rollout, entry.check):
        if target:
            path, names = defined_names(target)
            assert target.partition(":")[2] in names, f"{target}: not defined in {path}"
    assert isinstance(entry.spec_type()(), msgspec.Struct)
    if entry.export:  # a module (read, not imported: torch and safetensors)
        path = ROOT / (entry.export.replace(".", "/") + ".py")
        defined = {
            n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)
        }
        assert {"is_checkpoint", "export_checkpoint"} <= defined, path
        assert entry.trainer, f"{name} exports checkpoints but is no trainer"


def test_export_asks_the_registrys_trainers_and_names_them_when_none_claims(
    tmp_path: Path,
) -> None:
    assert registry.exporters() == {
        "fsdp": "timeshare.engines.fsdp.export",
        "megatron": "timeshare.engines.megatron.export",
    }
    exported = subprocess.run(
        [sys.executable, "-m", "timeshare", "export", str(tmp_path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert exported.returncode == 2, exported.stderr
    assert "no checkpoint of a trainer that exports (fsdp, megatron)" in exported.stderr
    assert not (tmp_path / "out").exists()


def test_kinds_and_lookups_name_what_exists() -> None:
    assert registry.kinds("trainer") == ["simulated", "torch_ref", "fsdp", "megatron"]
    assert registry.kinds("rollout") == ["simulated", "torch_ref", "vllm", "sglang"]
    with pytest.raises(
        ConfigError, match=r"no such engine; rollout engines are simulated, torch_ref, vllm, sglang"
    ):
        registry.find("deepspeed", "rollout")
    with pytest.raises(ConfigError, match=r"megatron is not a rollout engine"):
        registry.find("megatron", "rollout")
    with pytest.raises(ConfigError, match=r"sglang is not a trainer engine"):
        registry.find("sglang", "trainer")


@pytest.fixture
def echo_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[EngineChoice]]:
    """The registry with the echo engine's one entry, and `[engine]` as it types then."""
    monkeypatch.setitem(registry.ENGINES, "echo", ECHO)
    yield engine_spec_module.engine_spec_type()


def test_a_new_engine_is_its_package_and_one_entry(
    echo_registered: type[EngineChoice], tmp_path: Path
) -> None:
    spec = msgspec.convert(JOB, echo_registered)
    check_engines(spec)
    with pytest.raises(ConfigError, match=r"engine\.echo\.max_tokens \(5\) is shorter"):
        check_engines(msgspec.convert({**JOB, "echo": {"max_tokens": 5}}, echo_registered))
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `volume` - at `\$\.echo`"):
        msgspec.convert({**JOB, "echo": {"volume": 11}}, echo_registered)
    assert "echo" in registry.kinds("rollout")
    store = JobStore.host()
    context = EngineContext(spec=spec, rank=0, world_size=1, store=store, runtime_dir=tmp_path)
    trainer, rollout = build_trainer(context), build_rollout(context)
    transfer = TransferConfig(bucket_mb=0.05)
    endpoint = f"ipc://{tmp_path}/w.sock"
    inlet = rollout.open_inlet(endpoint, transfer)
    with ThreadPoolExecutor(1) as side:
        sender = side.submit(WeightSender, endpoint, transfer).result()
        try:
            weights = list(trainer.iter_weights())
            sent = side.submit(anyio.run, partial(sender.send, weights, version=0))
            received = inlet.receive(lambda: None)
            assert sent.result(timeout=60).bytes == received.bytes > 0
        finally:
            side.submit(sender.close).result(timeout=30)
            inlet.close()
    tensors = [(name, w) for name, w in weights if isinstance(w, torch.Tensor)]
    assert len(tensors) == len(weights)  # the reference trainer lends no staging
    assert rollout.digest() == weights_digest(tensors)
    workload = workload_of(context)
    requests = workload.requests(0, 0)
    samples = rollout.generate(requests)
    batch = workload.scored(requests, samples, 0, lambda: None)
    figures = trainer.train_step(batch)
    assert (figures.step, figures.samples, figures.reward_mean) == (1, 8, 1.0)
    trainer.close()
    rollout.close()


def test_the_command_line_lists_and_reads_a_new_engine(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        '[engine]\ntrainer = "torch_ref"\nrollout = "echo"\n[engine.echo]\nlogprob = -1.0\n'
    )
    script = (
        "import sys\n"
        "from timeshare.engines import registry\n"
        "from tests.engines.echo import ENTRY\n"
        "registry.ENGINES['echo'] = ENTRY  # before the config types [engine]\n"
        "from timeshare.daemon.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )

    def timeshare(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=ROOT,
        )

    shown = timeshare("config", "show", str(job))
    assert shown.returncode == 0, shown.stderr
    assert f"engine.echo.logprob = -1.0  # file {job}" in shown.stdout.splitlines()
    assert "engine.echo.max_tokens = 32  # default" in shown.stdout.splitlines()
    assert "echo       rollout          echoes the prompt's digit" in timeshare("--help").stdout
