"""The Megatron trainer in real processes (gloo over a loopback TCPStore), two ranks as one
tensor-parallel group (TP=2) and as two data-parallel replicas (TP=1) of the same model: the
loaded model's logits against transformers', the same losses and weights after the same steps,
the weights SYNC sends, the offload round trip, a resume, and the export of the TP=2 checkpoint
loaded back by transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.engines.megatron.rank import LENGTHS, PROBE, STEPS
from tests.ports import free_port
from timeshare.engines.model_dir import ModelShape, init_model_dir

WORLD = 2
RANK_TIMEOUT_S = 240.0
ROOT = Path(__file__).resolve().parents[3]
# Grouped-query attention (4 heads, 2 KV groups): each TP rank holds one KV group.
SHAPE = ModelShape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=16)
# Qwen2: Llama's table and biases on q, k and v; two KV groups a rank at TP=2.
QWEN2 = ModelShape(
    arch="qwen2", layers=2, hidden=64, intermediate=96, heads=8, kv_heads=4, vocab=16
)
# fp32 reductions in another order (the TP all-reduces, the vocab-parallel softmax)
LOGITS_ATOL = 1e-5
LOSS_ATOL = 1e-6
WEIGHTS_ATOL = 1e-5  # after three AdamW steps from the same rows

pytestmark = pytest.mark.slow


def run_ranks(
    scenario: str, tp: int, model_dir: Path, out: Path, world: int = WORLD
) -> list[dict[str, Any]]:
    """Every rank of `scenario` in its own process; their results, by rank."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.engines.megatron.rank", scenario]
    ranks = [
        subprocess.Popen(
            [*argv, str(rank), str(world), str(port), str(tp), str(model_dir), str(out)],
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outputs = [process.communicate(timeout=RANK_TIMEOUT_S)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()
            process.wait(timeout=10)
    for rank, (process, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank}:\n{output[-4000:]}"
    name = "resumed" if scenario == "resume" else "rank"
    return [torch.load(out / f"{name}{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("megatron") / "model", SHAPE, seed=3)


@pytest.fixture(scope="module")
def tp2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp("tp2")
    return out, run_ranks("train", 2, model_dir, out)


@pytest.fixture(scope="module")
def tp1(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp("tp1")
    return out, run_ranks("train", 1, model_dir, out)


def transformers_logits(model_dir: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits: torch.Tensor = model(PROBE).logits
    return logits


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


def test_the_loaded_model_computes_the_logits_of_transformers(
    model_dir: Path, tp2: tuple[Path, list[Any]], tp1: tuple[Path, list[Any]]
) -> None:
    expected = transformers_logits(model_dir)
    for results in (tp2[1], tp1[1]):
        for rank in results:
            assert rank["logits"].shape == expected.shape
            assert float((rank["logits"] - expected).abs().max()) <= LOGITS_ATOL


def test_a_qwen2_model_computes_the_logits_of_transformers_at_tp2(tmp_path: Path) -> None:
    model_dir = init_model_dir(tmp_path / "qwen2", QWEN2, seed=5)
    expected = transformers_logits(model_dir)
    for rank in run_ranks("logits", 2, model_dir, tmp_path):
        assert float((rank["logits"] - expected).abs().max()) <= LOGITS_ATOL


def test_logprobs_of_a_padded_batch_are_each_row_alone_at_either_layout(
    tp2: tuple[Path, list[Any]], tp1: tuple[Path, list[Any]]
) -> None:
    """Each rank's batch has rows of differing lengths and widths of its own; at TP=2 the
    group pads both to its widest before it gathers them: every row's logprobs are its own,
    as one length per row (no padding reaches them) and as TP=1 computes them."""
    for rank, (tp2_rank, tp1_rank) in enumerate(zip(tp2[1], tp1[1], strict=True)):
        batch, alone = tp2_rank["batch_logprobs"], tp2_rank["alone_logprobs"]
        assert [len(row) for row in batch] == LENGTHS[rank]
        assert rows_diff(batch, alone) <= LOGITS_ATOL
        assert rows_diff(batch, tp1_rank["batch_logprobs"]) <= LOGITS_ATOL
        assert rows_diff(tp1_rank["batch_logprobs"], tp1_rank["alone_logprobs"]) <= LOGITS_ATOL


def rows_diff(a: list[tuple[float, ...]], b: list[tuple[float, ...]]) -> float:
    assert [len(row) for row in a] == [len(row) for row in b]
    rows = zip(a, b, strict=True)
    return max(abs(x - y) for one, other in rows for x, y in zip(one, other, strict=True))


def test_sync_sends_the_model_directory_under_its_names_bit_for_bit(
    model_dir: Path, tp2: tuple[Path, list[Any]], tp1: tuple[Path, list[Any]]
) -> None:
    hf = load_file(model_dir / "model.safetensors")
    for rank in [*tp2[1], *tp1[1]]:
        assert same_bytes(rank["initial"], hf)


def test_tp2_and_two_replicas_take_the_same_steps(
    tp2: tuple[Path, list[Any]], tp1: tuple[Path, list[Any]]
) -> None:
    group, replicas = tp2[1], tp1[1]
    # Within a layout every rank reports the job's loss and sends the same weights.
    for results in (group, replicas):
        assert results[0]["losses"] == results[1]["losses"]
        for step in range(STEPS):
            assert same_bytes(results[0]["weights"][step], results[1]["weights"][step])
    # Across layouts: the same rows in each optimiser step, reduced in another order.
    assert group[0]["losses"] == pytest.approx(replicas[0]["losses"], abs=LOSS_ATOL)
    for step in range(STEPS):
        assert max_diff(group[0]["weights"][step], replicas[0]["weights"][step]) <= WEIGHTS_ATOL
    assert max_diff(group[0]["weights"][-1], group[0]["initial"]) > 1e-4  # it trained


def test_offload_restores_shards_gradients_and_optimiser_state_bit_for_bit(
    tp2: tuple[Path, list[Any]],
) -> None:
    for rank in tp2[1]:
        kinds = {key.split("/")[0] for key in rank["roundtrip"]}
        assert kinds == {"param", "grad", "state"}
        assert all(rank["roundtrip"].values())
        held, after_offload, after_params = rank["held_mb"]
        assert held > after_offload > 0 and after_params == 0.0


def test_a_new_trainer_resumes_from_the_committed_step(tp2: tuple[Path, list[Any]]) -> None:
    for rank in tp2[1]:
        assert rank["resumed_step"] == STEPS
        assert same_bytes(rank["resumed"], rank["weights"][-1])
        assert same_bytes(rank["next_step_resumed"], rank["next_step"])  # optimiser state too
        assert not same_bytes(rank["next_step"], rank["weights"][-1])


def test_a_job_of_one_replica_resumes_the_checkpoint_of_two(
    model_dir: Path, tp1: tuple[Path, list[Any]]
) -> None:
    # TP=1 over two ranks wrote it (two data-parallel replicas); one rank reads its TP rank's
    # shards and goes on from the same step with the same weights.
    out, results = tp1
    (resumed,) = run_ranks("resume", 1, model_dir, out, world=1)
    assert resumed["step"] == STEPS + 1
    assert same_bytes(resumed["weights"], results[0]["next_step"])


def test_the_export_loads_in_transformers_with_the_trained_logits(
    tp2: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    out, results = tp2
    exported = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "timeshare", "export", str(out / "checkpoints"), str(exported)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RANK_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step-{STEPS + 1:08d}" in done.stdout  # the newest committed: after the resume
    assert same_bytes(load_file(exported / "model.safetensors"), results[0]["next_step"])
    logits = transformers_logits(exported)
    assert float((logits - results[0]["final_logits"]).abs().max()) <= LOGITS_ATOL
