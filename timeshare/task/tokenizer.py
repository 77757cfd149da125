"""The job's tokenizer, as the rollout worker uses it: the one place text becomes tokens.

A chat (a list of {role, content}) is rendered by the tokenizer's chat template to TEXT, and that
text encoded once with no special tokens added: the template wrote them (a BOS added again by
the encoding would start the prompt with BOS twice). A plain string is encoded as the tokenizer
encodes a text, its own special tokens added once. Either way a prompt that starts with BOS
twice is refused. (transformers 5's `apply_chat_template(tokenize=True)` returns a dict, not ids:
it is never asked for.)

Engines are token-in/token-out and trainers never tokenize, so the tokens trained on are the
tokens sampled, by construction. Completions are decoded here for whoever needs their text.
Tokenizers are read from local files only (`local_files_only`: never a hub download).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from timeshare.errors import ConfigError
from timeshare.task import digit_tokenizer
from timeshare.task.files import TokenizerSource, generation_eos, stop_set

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, str]  # {"role": "user", "content": "..."}
Prompt = str | Sequence[Message]


class TaskTokenizer:
    """A transformers tokenizer with the generation config's EOS; `where` names its source."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        where: str,
        generation_eos: tuple[int, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.where = where
        self.generation_eos = generation_eos
        eos = tokenizer.eos_token_id
        self.tokenizer_eos: tuple[int, ...] = () if eos is None else (int(eos),)
        if not self.tokenizer_eos and not generation_eos:
            raise ConfigError(
                f"{where}: the tokenizer names no EOS token, nor does generation_config.json: "
                "no completion could end"
            )

    def __len__(self) -> int:
        """Its tokens, added ones included: the model's vocabulary must hold them all."""
        return len(self.tokenizer)

    @property
    def eos_id(self) -> int:
        """The token a right completion ends with: the tokenizer's EOS (else the generation
        config's first)."""
        return (self.tokenizer_eos or self.generation_eos)[0]

    def stop_set(self, job: Iterable[int] = ()) -> tuple[int, ...]:
        """The tokenizer's EOS, the generation config's and the job's `stop_token_ids`."""
        return stop_set(self.tokenizer_eos, self.generation_eos, job)

    def prompt_ids(self, prompt: Prompt) -> tuple[int, ...]:
        """A prompt's token ids: a chat rendered by the template to text, then encoded with no
        special tokens added; a plain string encoded with the tokenizer's own, once."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = self.tokenizer.encode(self.render(prompt), add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[:2] == [bos, bos]:
            raise ConfigError(
                f"{self.where}: the prompt {prompt!r} starts with BOS twice (its text writes the "
                "BOS the tokenizer adds): give it without"
            )
        return tuple(int(i) for i in ids)

    def render(self, messages: Sequence[Message]) -> str:
        """A chat as the model reads it: the template's text, ending with the generation
        prompt (what the assistant's turn starts with)."""
        if not self.tokenizer.chat_template:
            raise ConfigError(f"{self.where}: the tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(
            [dict(message) for message in messages], tokenize=False, add_generation_prompt=True
        )
        if not isinstance(text, str):  # one chat renders to one text
            raise TypeError(f"apply_chat_template gave a {type(text).__name__}, not a text")
        return text

    def text_ids(self, text: str) -> tuple[int, ...]:
        """A text as it continues a prompt (an answer): no special tokens added."""
        return tuple(int(i) for i in self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """A completion's text (without its EOS, unless `skip_special_tokens` is False)."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str), "one sequence decodes to one text"
        return text


def load(source: TokenizerSource) -> TaskTokenizer:
    """The tokenizer `source` names: its directory's (transformers' AutoTokenizer, local files
    only), or the digit task's built in memory; with its model's generation config's EOS."""
    tokenizer: PreTrainedTokenizerBase
    if source.is_digit_task:
        tokenizer = digit_tokenizer.build()
    else:
        from transformers import AutoTokenizer  # noqa: PLC0415 - for this, in the worker only

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.directory, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{source.where}: transformers cannot read its tokenizer: {exc}"
            ) from exc
    model_dir = Path(source.model_dir) if source.model_dir else None
    return TaskTokenizer(tokenizer, where=source.where, generation_eos=generation_eos(model_dir))


def digit_task_tokenizer() -> TaskTokenizer:
    """The digit task's tokenizer (a model given inline), built in memory."""
    return load(TokenizerSource(directory="", where="the digit task's tokenizer"))
