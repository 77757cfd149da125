"""Batch invariance on a CPU, the project's own mode (`[engine] batch_invariant = true`): a row's
numbers do not depend on the rows beside it or on how many there are, so that the rollout's
logprobs of a sequence, sampled in a batch one token at a time, are bit for bit the trainer's,
computed over whole sequences in a batch of another size.

What plain fp32 torch on this CPU does otherwise (FIELD-NOTES, "Batch invariance"): MKL's GEMM
rounds a row differently for 1, 2-3 and 4+ rows; scaled_dot_product_attention differs between a
prefill and a decode, and with masked keys. What this mode does instead, in the process of each
engine that turns it on:

- MKL's conditional numerical reproducibility, strict (`MKL_CBWR`), set before its first GEMM
  and then checked: with it, a GEMM of at least `MIN_GEMM_ROWS` rows rounds each row alike on
  any number of threads (plain MKL does on one thread only), and on any CPU of the AVX2 family
  (the trainer and the rollout of a rank may run on machines of different instruction sets);
- every linear call of the model gets at least that many rows (`padded_linear`: a decode batch of
  fewer is padded with zero rows);
- attention as sums over each query's own visible keys (`row_local_attention`): the same shapes
  and the same reductions for a query whether it came in a prefill, a decode or a whole sequence.

RMSNorm, rotary embeddings and log_softmax are row-invariant as they are.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from timeshare.errors import TimeshareError

CBWR_ENV = "MKL_CBWR"
STRICT_CBWR = "AVX2,STRICT"
MIN_GEMM_ROWS = 4  # with STRICT_CBWR, MKL rounds a row alike in every GEMM of 4 rows or more


def enable_strict_gemm() -> None:
    """Turn MKL's strict reproducibility on in this process, and check that it took: MKL reads
    the setting once, at its first GEMM, and a process that computed before keeps its own."""
    os.environ[CBWR_ENV] = STRICT_CBWR
    if not gemm_is_row_invariant():
        raise TimeshareError(
            f"engine.batch_invariant: {CBWR_ENV}={STRICT_CBWR} did not take in this process "
            "(MKL ran a GEMM before the engine was built); a GEMM's rows still round by the "
            "number of rows"
        )


def gemm_is_row_invariant() -> bool:
    """Whether GEMMs of 5, 6 and 7 rows on two threads give each row as one of 8 rows gives it.
    (Plain MKL computes the rows past a multiple of 4 another way there; on one thread it is
    row-invariant from 4 rows too, so one thread cannot tell the modes apart. Seeded: the same
    inputs every time.)"""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    rows = torch.randn(8, 64, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        whole = F.linear(rows, weight)
        return all(torch.equal(F.linear(rows[:n], weight), whole[:n]) for n in (5, 6, 7))
    finally:
        torch.set_num_threads(threads)


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as one GEMM of at least `MIN_GEMM_ROWS` rows."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count < MIN_GEMM_ROWS:
        rows = torch.cat((rows, rows.new_zeros(MIN_GEMM_ROWS - count, rows.shape[1])))
    out = F.linear(rows, weight, bias)[:count]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class PaddedLinear(nn.Linear):
    """`nn.Linear` as one GEMM of at least `MIN_GEMM_ROWS` rows (`pad_linears` makes a model's
    linear layers this class: their parameters and names stay as they were)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded_linear(x, self.weight, self.bias)


def pad_linears(model: nn.Module) -> int:
    """Every `nn.Linear` of `model` a `PaddedLinear`; how many."""
    linears = [module for module in model.modules() if type(module) is nn.Linear]
    for module in linears:
        module.__class__ = PaddedLinear
    return len(linears)


def row_local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int, scale: float
) -> torch.Tensor:
    """Causal attention of `q` [batch, heads, seq, dim] at positions first_position... over `k`
    and `v` [batch, kv_heads, first_position + seq, dim] (kv_heads dividing heads: grouped-query
    attention), scores scaled by `scale`: each query over its own visible keys alone (no masked
    ones), with sums along the innermost dimension (the same reduction for the same number of
    keys, whatever the batch)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outputs = []
    for i in range(q.shape[2]):
        visible = first_position + i + 1
        query = q[:, :, i : i + 1]  # [batch, heads, 1, dim]
        scores = (query * k[:, :, :visible]).sum(-1) * scale  # [batch, heads, visible]
        weights = torch.softmax(scores, dim=-1).unsqueeze(-2)  # [batch, heads, 1, visible]
        values = v[:, :, :visible].transpose(-1, -2)  # [batch, heads, dim, visible]
        outputs.append((weights * values).sum(-1))  # [batch, heads, dim]
    return torch.stack(outputs, dim=2)
