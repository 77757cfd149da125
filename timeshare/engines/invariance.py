"""Batch invariance on a CPU, the project's own mode (`[engine] batch_invariant = true`): a row's
numbers do not depend on the rows beside it or on how many there are, so that the rollout's
logprobs of a sequence, sampled in a batch one token at a time, are bit for bit the trainer's,
computed over whole sequences in a batch of another size.

What plain fp32 torch on this CPU does otherwise (FIELD-NOTES, "Batch invariance"): MKL's GEMM
rounds a row differently for 1, 2-3 and 4+ rows; scaled_dot_product_attention differs between a
prefill and a decode, and with masked keys. What this mode does instead, in the process of each
engine that turns it on:

- MKL's conditional numerical reproducibility, strict (`MKL_CBWR`), set before its first GEMM
  and then checked (MKL is asked which mode it runs): with it, a GEMM of at least
  `MIN_GEMM_ROWS` rows rounds each row alike on any number of threads (plain MKL does on one
  thread only), and on any CPU of the AVX2 family (the trainer and the rollout of a rank may
  run on machines of different instruction sets);
- every linear call of the model gets at least that many rows (`padded_linear`: a decode batch of
  fewer is padded with zero rows);
- attention as sums over each query's own visible keys (`row_local_attention`): the same shapes
  and the same reductions for a query whether it came in a prefill, a decode or a whole sequence.

RMSNorm, rotary embeddings and log_softmax are row-invariant as they are.

It is a CPU mode: an engine on CUDA computes its GEMMs with cuBLAS, which no setting here makes
match a rollout's kernels (the config refuses it there: spec.py `check_batch_invariant`).

The switch comes from the job's config alone: a worker removes the switches it inherited
(`SWITCH_VARIABLES`) before it builds its engine (pairs.py), so that with the switch off neither
its MKL nor the processes an engine starts (vLLM's) read one by accident; an engine turns on
its own.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from timeshare.engines.spec import off_cpu_refusal
from timeshare.errors import ConfigError, TimeshareError

log = structlog.get_logger(__name__)

CBWR_ENV = "MKL_CBWR"
STRICT_CBWR = "AVX2,STRICT"
MIN_GEMM_ROWS = 4  # with STRICT_CBWR, MKL rounds a row alike in every GEMM of 4 rows or more
# What MKL answers for STRICT_CBWR (mkl_service.h: MKL_CBWR_AVX2 | MKL_CBWR_STRICT)
STRICT_CBWR_MODE = 0xA | 0x10000
_CBWR_ALL = -1  # MKL_CBWR_ALL (~0): the branch and the strict flag
# The batch-invariance switches an engine's process could inherit: MKL's, and vLLM's (which
# every process vLLM starts would read; vllm/spec.py's BATCH_INVARIANT_ENV, named here as a
# string: shared modules name no engine)
SWITCH_VARIABLES = (CBWR_ENV, "VLLM_BATCH_INVARIANT")


def remove_inherited_switches() -> list[str]:
    """Remove from this process's environment the switches of `SWITCH_VARIABLES` it
    inherited, before its engine is built (and its first GEMM: MKL reads its setting then);
    which were there. The engine sets its own from `[engine] batch_invariant`."""
    removed = [name for name in SWITCH_VARIABLES if os.environ.pop(name, None) is not None]
    if removed:
        log.warning(
            "engine.inherited_switch_removed",
            removed=removed,
            why="[engine] batch_invariant alone turns batch invariance on",
        )
    return removed


def mkl_cbwr_mode() -> int | None:
    """The reproducibility mode torch's MKL runs in this process (`mkl_cbwr_get(MKL_CBWR_ALL)`:
    `STRICT_CBWR_MODE` under the mode), None where torch has no MKL to ask. MKL fixes its mode
    the first time it is asked or computes, from `MKL_CBWR` as it is then: ask only after it
    was set."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        torch_cpu = ctypes.CDLL(str(library))
    except OSError:
        return None
    for name in ("mkl_cbwr_get", "mkl_serv_cbwr_get"):  # (torch links MKL statically)
        get = getattr(torch_cpu, name, None)
        if get is not None:
            get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
            mode: int = get(_CBWR_ALL)
            return mode
    return None


def enable_strict_gemm() -> None:
    """Turn MKL's strict reproducibility on in this process, and check that it took: MKL reads
    the setting once, at its first GEMM, and a process that computed before keeps its own.
    MKL is asked which mode it runs (where torch's MKL can be asked), and a GEMM probe checks
    the rows round alike (which plain MKL may do too on some CPUs: the probe alone cannot tell
    that MKL ran before)."""
    os.environ[CBWR_ENV] = STRICT_CBWR
    mode = mkl_cbwr_mode()
    if (mode is not None and mode != STRICT_CBWR_MODE) or not gemm_is_row_invariant():
        running = "" if mode is None else f" (MKL runs mode {mode:#x}, not {STRICT_CBWR_MODE:#x})"
        raise TimeshareError(
            f"engine.batch_invariant: {CBWR_ENV}={STRICT_CBWR} did not take in this process"
            f"{running}: MKL ran a GEMM before the engine was built, and a GEMM's rows may "
            "still round by the number of rows"
        )


def auto_device_problem(key: str) -> str:
    """The config's probe of an engine whose device `key` is "auto", under the switch: refused
    where this process's torch sees a CUDA device (where the worker's "auto" is CUDA too:
    sharded_trainer.pick_device), "" where it sees none."""
    if torch.cuda.is_available():
        return off_cpu_refusal(key, f'{key} = "auto" is cuda here (torch sees a CUDA device)')
    return ""


def require_cpu(device: torch.device, key: str, value: str) -> None:
    """A `ConfigError` unless `device` (what `key` = `value` means in this process) is the
    CPU: the mode is a CPU mode. The config refuses it before any worker starts; this is for a
    process that resolves "auto" otherwise than the config's check did."""
    if device.type != "cpu":
        raise ConfigError(off_cpu_refusal(key, f'{key} = "{value}" is {device.type} here'))


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
