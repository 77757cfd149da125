"""The digit task as data read through a tokenizer: the requests the rollout worker builds hold
the ids the models learn (`BOS d.. SEP`, answers `d EOS`), through the digit
task's tokenizer built in memory or read from a model directory alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from timeshare.engines.model_dir import ModelShape, init_model_dir
from timeshare.engines.spec import engine_spec
from timeshare.engines.task import TaskWorkload, workload
from timeshare.errors import ConfigError
from timeshare.task import digit_tokenizer
from timeshare.task import tokenizer as tokenizers
from timeshare.task.digits import RepeatDigit, examples
from timeshare.task.files import TokenizerSource
from timeshare.task.seeds import mix
from timeshare.task.vocab import BOS, DIGITS, EOS, PROMPT_DIGITS, SEP

TASK = {"prompts_per_rank": 6, "group_size": 2, "stop_token_ids": [3]}


def expected_prompts(seed: int, rank: int, step: int, count: int) -> list[tuple[int, ...]]:
    """The prompt ids as the task wrote them before it had a tokenizer (ids, not text)."""
    generator = torch.Generator().manual_seed(mix(seed, rank, step, 1))
    digits = torch.randint(0, DIGITS, (count,), generator=generator).tolist()
    offset = int(torch.randint(0, PROMPT_DIGITS, (1,), generator=generator))
    repeats = [1 + (offset + i) % PROMPT_DIGITS for i in range(count)]
    return [(BOS, *[d] * n, SEP) for d, n in zip(digits, repeats, strict=True)]


def test_the_requests_through_the_tokenizer_are_the_tasks_ids() -> None:
    spec = engine_spec(trainer="torch_ref", rollout="torch_ref", task=TASK)
    served = workload("causal_lm", spec)
    assert isinstance(served, TaskWorkload)
    for rank, step in [(0, 0), (1, 0), (0, 7)]:
        requests = served.requests(rank, step)
        prompts = expected_prompts(0, rank, step, 6)
        assert [r.prompt_tokens for r in requests] == [p for p in prompts for _ in range(2)]
        assert {r.sampling.stop_token_ids for r in requests} == {(3, EOS)}
    assert examples(0, 0, 0, 1)[0].messages[0]["role"] == "user"


def test_a_model_directorys_tokenizer_serves_the_same_requests(tmp_path: Path) -> None:
    model_dir = init_model_dir(tmp_path / "model", ModelShape(vocab=16), seed=0)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 15]}))
    inline = engine_spec(trainer="torch_ref", rollout="torch_ref", task=TASK)
    fsdp = engine_spec(
        trainer="fsdp", rollout="vllm", task=TASK, fsdp={"model_dir": str(model_dir)}
    )
    source = fsdp.tokenizer_source()
    assert source == TokenizerSource(
        str(model_dir), f"engine.fsdp.model_dir {model_dir}", str(model_dir)
    )
    a, b = workload("causal_lm", inline), workload("causal_lm", fsdp)
    assert [r.prompt_tokens for r in a.requests(0, 3)] == [
        r.prompt_tokens for r in b.requests(0, 3)
    ]
    assert b.requests(0, 3)[0].sampling.stop_token_ids == (3, EOS, 15)  # generation_config's too
    named = engine_spec(
        trainer="fsdp",
        rollout="vllm",
        task={**TASK, "tokenizer": str(tmp_path / "tok")},
        fsdp={"model_dir": str(model_dir)},
    )
    digit_tokenizer.save(tmp_path / "tok")
    assert named.tokenizer_source() == TokenizerSource(
        str(tmp_path / "tok"), f"engine.task.tokenizer {tmp_path / 'tok'}", str(model_dir)
    )


def test_the_reward_is_the_share_of_the_right_completion() -> None:
    task = RepeatDigit()
    assert task.answer((BOS, 7, 7, SEP)) == (7, EOS)
    assert task.reward((BOS, 7, SEP), (7, EOS)) == 1.0
    assert task.reward((BOS, 7, 7, 7, SEP), (1, EOS)) == 0.5  # stopped right, the wrong digit
    assert task.reward((BOS, 7, 7, SEP), (7, 7, EOS)) == 0.5  # the digit, stopped late
    assert task.reward((BOS, 7, 7, SEP), (EOS,)) == 0.0  # stopped before the digit
    assert task.reward((BOS, 7, SEP), (7, 7, 7, 7, 7, 7)) == 0.0  # never stopped: cut
    assert task.reward((BOS, 7, 8, SEP), (7, EOS)) == 0.0  # not a prompt of the task
    assert task.reward((BOS, 7, SEP), ()) == 0.0


def test_prompts_longer_than_max_prompt_tokens_are_refused_at_start(tmp_path: Path) -> None:
    digit_tokenizer.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}0 0 0 0 " + config["chat_template"]  # 4 more
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    wordy = tokenizers.load(TokenizerSource(str(tmp_path), "engine.task.tokenizer wordy", ""))
    spec = engine_spec(task=TASK).task
    with pytest.raises(ConfigError, match=r"max_prompt_tokens \(8\) is shorter .* \(10 tokens"):
        TaskWorkload(spec, wordy)
