"""The FSDP trainer in two real processes (gloo over a loopback TCPStore) against one unsharded
process: the same loss, gradients and AdamW step; its weights out bit for bit; the offload
round trip bit for bit; the memory a gather of the weights takes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.engines.fsdp.rank import GROUP, GRPO, PER_RANK, SPEC_KEYS, TASK, global_batch
from tests.ports import free_port
from timeshare.engines.grpo import completion_logprobs
from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.sequences import pack
from timeshare.task.grpo_math import clipped_loss, group_advantages, token_weights

WORLD = 2
RANK_TIMEOUT_S = 240.0
ROOT = Path(__file__).resolve().parents[3]
SHAPE = ModelShape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=16)


def run_ranks(scenario: str, model_dir: Path, out: Path) -> list[dict[str, Any]]:
    """Every rank of `scenario` in its own process; their results, by rank."""
    port = free_port()
    # Big allocations mapped and unmapped on free, so that the resident peak is the live bytes.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    argv = [sys.executable, "-m", "tests.engines.fsdp.rank", scenario]
    ranks = [
        subprocess.Popen(
            [*argv, str(rank), str(WORLD), str(port), str(model_dir), str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    try:
        outputs = [process.communicate(timeout=RANK_TIMEOUT_S)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()
            process.wait(timeout=10)
    for rank, (process, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank}:\n{output[-4000:]}"
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("fsdp") / "model", SHAPE, seed=3)


@pytest.fixture(scope="module")
def trained(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("train", model_dir, tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="module")
def unsharded(model_dir: Path) -> Iterator[dict[str, Any]]:
    """The same step in one process, no FSDP: the whole batch at once (both ranks' rows,
    padded to the widest of all), clipped, AdamW. Each rank's loss is the token mean over its
    own rows, and FSDP averages the ranks' gradients: the job's loss is the mean of the two."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = global_batch(1, WORLD)
    sequences = pack(batch)
    rewards = torch.tensor([s.reward or 0.0 for s in batch])
    weights = token_weights(sequences.mask, GRPO.loss_aggregation, PER_RANK) / WORLD

    def logprobs() -> torch.Tensor:
        logits = model(input_ids=sequences.tokens[:, :-1]).logits
        return completion_logprobs(logits, sequences, TASK.temperature)

    with torch.no_grad():
        old = logprobs()
    loss, _ = clipped_loss(
        logprobs(),
        old,
        group_advantages(rewards, GROUP),
        weights,
        clip_low=GRPO.clip_ratio_low,
        clip_high=GRPO.clip_ratio_high,
    )
    loss.backward()  # type: ignore[no-untyped-call]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.nn.utils.clip_grad_norm_(model.parameters(), SPEC_KEYS["max_grad_norm"])
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=GRPO.lr, weight_decay=GRPO.weight_decay, betas=(0.9, 0.99)
    )
    optimizer.step()
    stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    yield {"loss": float(loss.detach()), "grads": grads, "stepped": stepped}


@pytest.mark.slow
def test_two_ranks_give_the_loss_gradients_and_step_of_one_process(
    trained: list[dict[str, Any]], unsharded: dict[str, Any]
) -> None:
    # Each rank's loss is the token mean over its half (padded to its own widths); their mean
    # is the job's, computed here over both halves padded to the widest row of all.
    assert sum(r["loss"] for r in trained) / WORLD == pytest.approx(unsharded["loss"], abs=1e-6)
    for rank in trained:
        assert rank["grads"].keys() == unsharded["grads"].keys()
        for name, grad in unsharded["grads"].items():
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-4, atol=1e-6)
        for name, weight in unsharded["stepped"].items():
            torch.testing.assert_close(rank["stepped"][name], weight, rtol=1e-4, atol=1e-5)
    # The step moved the weights (so equal weights above are not just the initial ones).
    assert any(
        not torch.equal(trained[0]["stepped"][n], w) for n, w in trained[0]["initial"].items()
    )


@pytest.mark.slow
def test_the_weights_out_are_the_model_bit_for_bit(
    trained: list[dict[str, Any]], model_dir: Path
) -> None:
    files = load_file(model_dir / "model.safetensors")
    for rank in trained:
        initial = rank["initial"]
        assert initial.keys() == files.keys()
        assert all(torch.equal(initial[n], files[n]) for n in files)
    # After a step: what DCP's full state dict (another gather) says, on rank 0 where it lands.
    reference = trained[0]["full_state_dict"]
    stepped = trained[0]["stepped"]
    assert stepped.keys() == reference.keys()
    assert all(torch.equal(stepped[n], reference[n]) for n in reference)
    assert all(torch.equal(trained[1]["stepped"][n], stepped[n]) for n in stepped)
    # Gathered here and then packed: the same bytes as gathered into staging.
    for rank in trained:
        then_pack = rank["stepped_then_pack"]
        assert then_pack.keys() == stepped.keys()
        assert all(torch.equal(then_pack[n], stepped[n]) for n in stepped)


@pytest.mark.slow
def test_offload_and_onload_are_bit_identical_and_free_the_memory(
    trained: list[dict[str, Any]],
) -> None:
    for rank in trained:
        keys = rank["roundtrip_keys"]
        # Parameters, gradients (present: a batch was accumulated) and AdamW's three states.
        assert {k.split("/")[0] for k in keys} == {"param", "grad", "state"}
        assert {k.rsplit("/", 1)[1] for k in keys if k.startswith("state/")} == {
            "step",
            "exp_avg",
            "exp_avg_sq",
        }
        assert all(rank["roundtrip"].values()), [k for k, ok in rank["roundtrip"].items() if not ok]
        full, after_offload, after_params = rank["held_mb"]
        assert full > after_offload > 0.0  # the parameters' shards are still held
        assert after_params == 0.0


@pytest.mark.slow
def test_gathering_the_weights_holds_about_one_layer_and_a_bucket(
    model_dir: Path, tmp_path: Path
) -> None:
    for rank in run_ranks("memory", model_dir, tmp_path):
        # gloo's all-gather on CPU may hold a second copy of the tensor it gathers (NCCL
        # gathers into the output), hence twice the largest layer.
        bound = 2 * rank["largest_mb"] + rank["bucket_mb"] + 8.0
        assert rank["streamed_mb"] <= bound, rank  # sync_gather = "then_pack"
        assert rank["lent_mb"] <= bound, rank  # "into_staging" (large layers: gathered whole)
        # The measurement can tell: gathering the whole model first goes well past it.
        assert rank["listed_mb"] > bound, rank
        assert rank["listed_mb"] >= 0.95 * rank["total_mb"], rank  # (resident pages: ±)
