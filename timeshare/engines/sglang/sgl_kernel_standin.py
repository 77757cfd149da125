"""timeshare's stand-in for `sgl_kernel`, SGLang's compiled kernels, on a CPU-only torch.

SGLang's CPU engine imports `sgl_kernel` at start-up. Upstream's CPU build of it is not on PyPI
(it compiles from SGLang's own tree) and PyPI's `sglang-kernel` is built for CUDA. A dense model
on the `torch_native` attention backend reaches two of its kernels, written here in torch:
`assign_req_to_token_pool_cpu` (a module function) and `murmur_hash32_cpu` (a torch op of the
`sgl_kernel` namespace: seeded sampling hashes seed, position and token with it). Anything else
SGLang takes from it is a stub that raises `NotImplementedError` naming itself when called,
never a silent no-op: the module's other attributes, and the few torch ops SGLang looks up as it
imports its multimodal processors (`LOOKED_UP_OPS`). Other torch ops stay undefined, so SGLang's
probes for optional kernels (`hasattr(torch.ops.sgl_kernel, ...)`) still answer no.
cpu_shims.py installs this module as `sgl_kernel`, and only where no real one is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch

from timeshare.engines.sglang.op_library import OpLibrary, op_library

STANDIN = "timeshare's sgl_kernel stand-in (engines/sglang/sgl_kernel_standin.py)"
__version__ = "0.0.0+timeshare.standin"


def assign_req_to_token_pool_cpu(  # noqa: PLR0917 - SGLang calls it positionally
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the token pool: request i's slots
    are the next `end_offset[i] - start_offset[i]` entries of `out_cache_loc` (requests in
    order), stored at columns start_offset[i]..end_offset[i] of row req_pool_indices[i]."""
    del pool_len  # the row length, which req_to_token's shape already says
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count]
        taken += count


MASK32 = 0xFFFFFFFF
# torch ops of the sgl_kernel namespace that SGLang's modules look up as they are imported (the
# Qwen3.5 model, which its Qwen-VL processors import), though a dense model never calls them.
LOOKED_UP_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_input_proj_cpu",
)


def _rotl32(x: torch.Tensor, bits: int) -> torch.Tensor:
    return ((x << bits) | (x >> (32 - bits))) & MASK32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's mixing of one 32-bit block `k` into the state `h` (int64 holding uint32:
    a product wraps modulo 2**64, which keeps its low 32 bits right)."""
    k = _rotl32((k * 0xCC9E2D51) & MASK32, 15)
    h = h ^ ((k * 0x1B873593) & MASK32)
    return (_rotl32(h, 13) * 5 + 0xE6546B64) & MASK32


def _finish(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def murmur_hash32(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    """MurmurHash3 (32 bits) of each row's seed (two blocks), position and each column index,
    as SGLang's Triton kernel computes it: an (rows, columns) uint32 tensor."""
    seed = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    rows = seed.reshape(-1, 1)
    h = torch.zeros_like(rows)
    h = _mix(h, rows & MASK32)
    h = _mix(h, (rows >> 32) & MASK32)
    h = _mix(h, positions.to(torch.int64).reshape(-1, 1) & MASK32)
    h = _mix(h, col_indices.to(torch.int64).reshape(1, -1) & MASK32)
    return _finish(h ^ 16).to(torch.uint32)


def register_torch_ops() -> None:
    """`torch.ops.sgl_kernel.murmur_hash32_cpu`, and loud stubs for `LOOKED_UP_OPS`."""
    library = op_library("sgl_kernel", "FRAGMENT")
    library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    library.impl("murmur_hash32_cpu", murmur_hash32, "CPU")
    library.impl("murmur_hash32_cpu", _murmur_hash32_shape, "Meta")
    _libraries.append(library)
    namespace = torch.ops.sgl_kernel
    for name in LOOKED_UP_OPS:
        setattr(namespace, name, _missing(name))


def _murmur_hash32_shape(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


_libraries: list[OpLibrary] = []  # kept alive: a dropped Library unregisters its ops


def _missing(name: str) -> Callable[..., NoReturn]:
    def missing(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, and {STANDIN} does not implement it: this model or "
            "setting needs SGLang's real kernels (build sgl-kernel for CPU from SGLang's tree, "
            "or run on a GPU install)"
        )

    missing.__name__ = missing.__qualname__ = name
    return missing


def __getattr__(name: str) -> Callable[..., NoReturn]:
    """Every other kernel: importable (SGLang imports many it never calls on this path), and
    loud once called."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
