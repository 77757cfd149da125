"""The job's tokenizer (timeshare/task/tokenizer.py): a chat rendered to text and encoded once,
exactly one BOS; the stop set as one union; tokenizers read from local files only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from timeshare.errors import ConfigError
from timeshare.task import digit_tokenizer
from timeshare.task import tokenizer as tokenizers
from timeshare.task.digits import every_example
from timeshare.task.files import (
    GENERATION_CONFIG,
    TokenizerSource,
    generation_eos,
    stop_set,
    tokenizer_facts,
)
from timeshare.task.tokenizer import TaskTokenizer
from timeshare.task.vocab import BOS, EOS, PAD, SEP, TOKENIZER_SIZE

SEVENS = [{"role": "user", "content": "7 7"}]


def test_a_chat_renders_to_text_then_ids_with_exactly_one_bos() -> None:
    tokenizer = tokenizers.digit_task_tokenizer()
    assert tokenizer.render(SEVENS) == "<bos>7 7<sep>"
    assert tokenizer.prompt_ids(SEVENS) == (BOS, 7, 7, SEP)
    # The trap it avoids: the template writes the BOS, and this tokenizer (as Llama's) adds
    # one to a text encoded with special tokens, transformers' default: BOS twice.
    hf = tokenizer.tokenizer
    assert hf.encode("<bos>7 7<sep>") == [BOS, BOS, 7, 7, SEP]
    # transformers 5 tokenizes a chat to a dict (BatchEncoding), not ids: never asked for
    assert not isinstance(hf.apply_chat_template(SEVENS, tokenize=True), list)
    assert all(type(i) is int for i in tokenizer.prompt_ids(SEVENS))


def test_a_plain_text_gets_the_tokenizers_bos_once_and_a_second_is_refused() -> None:
    tokenizer = tokenizers.digit_task_tokenizer()
    assert tokenizer.prompt_ids("7 7") == (BOS, 7, 7)
    assert tokenizer.prompt_ids("777") == (BOS, 7, 7, 7)  # a digit a token, spaced or not
    with pytest.raises(ConfigError, match="starts with BOS twice"):
        tokenizer.prompt_ids("<bos>7 7")


def test_completions_decode_and_answers_encode_without_special_tokens() -> None:
    tokenizer = tokenizers.digit_task_tokenizer()
    assert tokenizer.decode([7, 7, 7, EOS]) == "7 7 7"
    assert tokenizer.decode([7, EOS], skip_special_tokens=False) == "7 <eos>"
    assert tokenizer.text_ids("7 7 7") == (7, 7, 7)
    assert (len(tokenizer), tokenizer.eos_id) == (TOKENIZER_SIZE, EOS)
    assert tokenizer.tokenizer.pad_token_id == PAD


def test_the_saved_tokenizer_loads_with_auto_tokenizer_offline_and_is_the_built_one(
    tmp_path: Path,
) -> None:
    digit_tokenizer.save(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert "chat_template" in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (BOS, EOS, PAD)
    built = tokenizers.digit_task_tokenizer()
    from_files = tokenizers.load(TokenizerSource(str(tmp_path), "test", ""))
    for example in every_example():
        ids = from_files.prompt_ids(example.messages)
        assert ids == built.prompt_ids(example.messages)
        assert ids.count(BOS) == 1
    # its JSON says what transformers reads (the config checks read the JSON alone)
    facts = tokenizer_facts(tmp_path)
    assert (facts.size, facts.eos) == (len(loaded), (loaded.eos_token_id,))


def test_the_stop_set_is_the_union_of_tokenizer_generation_config_and_job(
    tmp_path: Path,
) -> None:
    assert stop_set((12,), (2, 12), (5,)) == (2, 5, 12)
    assert stop_set() == ()
    digit_tokenizer.save(tmp_path)
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps({"eos_token_id": [12, 14]}))
    assert generation_eos(tmp_path) == (12, 14)
    tokenizer = tokenizers.load(TokenizerSource(str(tmp_path), "test", str(tmp_path)))
    assert tokenizer.stop_set((3,)) == (3, 12, 14)
    assert tokenizer.stop_set() == (12, 14)
    no_model_dir = tokenizers.load(TokenizerSource(str(tmp_path), "test", ""))
    assert no_model_dir.stop_set((3,)) == (3, 12)
    # no generation_config.json: config.json's EOS, from which vLLM builds its generation
    # config (it must be in the stop set: vLLM is told to stop at the stop set alone)
    (tmp_path / GENERATION_CONFIG).unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 15}))
    assert generation_eos(tmp_path) == (15,)
    assert tokenizers.load(TokenizerSource(str(tmp_path), "t", str(tmp_path))).stop_set() == (
        12,
        15,
    )


def test_a_tokenizer_with_no_eos_or_no_chat_template_is_refused(tmp_path: Path) -> None:
    hf = digit_tokenizer.build()
    hf.eos_token = None
    with pytest.raises(ConfigError, match="no completion could end"):
        TaskTokenizer(hf, where="engine.task.tokenizer x")
    assert TaskTokenizer(hf, where="x", generation_eos=(EOS,)).eos_id == EOS
    plain = digit_tokenizer.build()
    plain.chat_template = None
    with pytest.raises(ConfigError, match=r"engine\.task\.tokenizer y: .* no chat template"):
        TaskTokenizer(plain, where="engine.task.tokenizer y").prompt_ids(SEVENS)


def test_a_directory_transformers_cannot_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^engine\.task\.tokenizer .*transformers cannot read"):
        tokenizers.load(TokenizerSource(str(tmp_path), f"engine.task.tokenizer {tmp_path}", ""))
