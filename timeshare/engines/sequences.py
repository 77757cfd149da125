"""One layout of a batch of variable-length samples, shared by every trainer (torch_ref, FSDP,
Megatron: the ranks of a tensor-parallel group must agree on shapes).

Each row is the sample's prompt, then its completion, then padding, right-padded:

    tokens  [rows, width]   p p p c c c EOS . .      (. = PAD; width: the longest row)
    completions [rows, completion_width]   c c c EOS .  (. = PAD)
    mask    [rows, completion_width]       1 1 1 1   0  (the completion through its EOS)

Right padding keeps every token at the position the rollout computed it at, and in causal
attention no real token sees a pad, so no padding mask is needed: a row's logprobs are those
it would have alone. The model reads `tokens[:, :-1]`; the logits that predict completion token
j of row r are at position `prompt_length[r] - 1 + j` (`completion_positions`). A padded
position gathers some real logit, is masked, and is never in a loss or a figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from timeshare.engines.base import RolloutSample
from timeshare.errors import TimeshareError

PAD = 0  # what padded positions hold: any token id the embedding has (its value is never read)


class Sequences(NamedTuple):
    tokens: torch.Tensor  # [rows, width] long: prompt ‖ completion ‖ PAD
    prompt_lengths: torch.Tensor  # [rows] long
    completions: torch.Tensor  # [rows, completion_width] long: completion ‖ PAD
    mask: torch.Tensor  # [rows, completion_width] bool: the completion's own tokens

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def completion_positions(self) -> torch.Tensor:
        """[rows, completion_width]: where in the logits of `tokens[:, :-1]` each completion
        token is predicted (padded positions clamped to the last: masked anyway)."""
        offsets = torch.arange(self.completions.shape[1], device=self.tokens.device)
        positions = self.prompt_lengths.to(self.tokens.device).unsqueeze(1) - 1 + offsets
        return positions.clamp(max=self.tokens.shape[1] - 2)

    def select(self, rows: slice) -> Sequences:
        """Rows `rows`, trimmed to the widths they need (fewer padded columns to compute)."""
        part = Sequences(*(t[rows] for t in self))
        return part.trimmed()

    def trimmed(self) -> Sequences:
        """The same rows without columns that are padding in every row."""
        if self.rows == 0:
            return self
        lengths = self.mask.sum(dim=1)
        completion_width = max(int(lengths.max()), 1)
        width = max(int((self.prompt_lengths + lengths).max()), 2)
        return Sequences(
            self.tokens[:, :width],
            self.prompt_lengths,
            self.completions[:, :completion_width],
            self.mask[:, :completion_width],
        )

    def padded(self, width: int, completion_width: int) -> Sequences:
        """The same rows padded to `width` and `completion_width` (at least their own)."""
        if width < self.tokens.shape[1] or completion_width < self.completions.shape[1]:
            raise ValueError(
                f"cannot pad a batch of widths {self.widths} to ({width}, {completion_width})"
            )
        grow = width - self.tokens.shape[1], completion_width - self.completions.shape[1]
        return Sequences(
            torch.nn.functional.pad(self.tokens, (0, grow[0]), value=PAD),
            self.prompt_lengths,
            torch.nn.functional.pad(self.completions, (0, grow[1]), value=PAD),
            torch.nn.functional.pad(self.mask, (0, grow[1]), value=False),
        )

    @property
    def widths(self) -> tuple[int, int]:
        return int(self.tokens.shape[1]), int(self.completions.shape[1])

    def to(self, device: torch.device | str) -> Sequences:
        return Sequences(*(t.to(device) for t in self))

    def padding_share(self) -> float:
        """The part of `tokens`' positions that are padding (what a forward computes for
        nothing)."""
        real = int(self.prompt_lengths.sum()) + int(self.mask.sum())
        return 1.0 - real / max(self.tokens.numel(), 1)


def pack(batch: Sequence[RolloutSample]) -> Sequences:
    """The batch in the shared layout. Every sample has a prompt and a completion."""
    if not batch:
        raise TimeshareError("an empty batch: the rollout produced no samples")
    empty = [s.request_id for s in batch if not s.prompt_tokens or not s.tokens]
    if empty:
        raise TimeshareError(f"samples with an empty prompt or completion: {empty[:5]}")
    completion_width = max(len(s.tokens) for s in batch)
    width = max(2, *(len(s.prompt_tokens) + len(s.tokens) for s in batch))
    tokens = torch.full((len(batch), width), PAD, dtype=torch.long)
    completions = torch.full((len(batch), completion_width), PAD, dtype=torch.long)
    mask = torch.zeros((len(batch), completion_width), dtype=torch.bool)
    for row, sample in enumerate(batch):
        prompt, completion = len(sample.prompt_tokens), len(sample.tokens)
        tokens[row, :prompt] = torch.tensor(sample.prompt_tokens)
        tokens[row, prompt : prompt + completion] = torch.tensor(sample.tokens)
        completions[row, :completion] = torch.tensor(sample.tokens)
        mask[row, :completion] = True
    lengths = torch.tensor([len(s.prompt_tokens) for s in batch], dtype=torch.long)
    return Sequences(tokens, lengths, completions, mask)


def padded_values(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Per-token numbers of each row (a rollout's logprobs) as [rows, width] float32, 0.0 where
    a row is shorter."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for row, values in enumerate(rows):
        out[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def completion_logits(logits: torch.Tensor, sequences: Sequences) -> torch.Tensor:
    """[rows, completion_width, vocab]: the logits (of `tokens[:, :-1]`, [rows, width - 1,
    vocab]) that predict each completion token."""
    positions = sequences.completion_positions().to(logits.device)
    index = positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return logits.gather(1, index)


def unpadded(values: torch.Tensor, sequences: Sequences) -> list[tuple[float, ...]]:
    """Each row's numbers of `values` [rows, completion_width] up to its completion's length."""
    lengths = sequences.mask.sum(dim=1).tolist()
    return [tuple(row[:n]) for row, n in zip(values.tolist(), lengths, strict=True)]
