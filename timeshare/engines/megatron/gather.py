"""Megatron's tensor-parallel parameters as HF-named weights, each gathered straight into the
weight channel's staging.

A megatron parameter is split over the TP group and may fuse several HF tensors (names.py).
Each HF tensor is sent on its own, under its HF name: every TP rank takes its chunk of it out of
its local parameter (`Rule.pieces`), and an all-gather over the TP group puts the chunks
together. Chunks split on rows gather straight into the staging the sender lends (the only
copy); chunks split on columns (row-parallel layers) gather rank-major, [tp, rows, cols/tp], and
are transposed into staging (one more copy of that tensor, through a buffer of its size).
Replicated tensors (norms) go as plain tensors: every rank holds them whole.

Every rank of the job iterates the same weights in the same order (`lent_weights`) and hands
each to its own sender, as FSDP's gather does: the all-gathers pair up rank by rank within each
TP group, and every data-parallel replica sends the same bytes to its own rollout engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from timeshare.engines.megatron.names import Geometry, Mapped
from timeshare.errors import TransferError
from timeshare.protocols.weights.lent import LentTensor

# torch 2.13 names it all_gather_single; older builds (a GPU user's) have the older name alone.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TpGather(LentTensor):
    """One HF tensor, gathered from every TP rank's chunk of it (`piece`) on `dim`."""

    def __init__(
        self,
        piece: torch.Tensor,
        *,
        dim: int,
        group: dist.ProcessGroup | None,
        tp: int,
        name: str,
        timeout_s: float | None = None,
    ) -> None:
        self.piece = piece  # this rank's chunk, in the dtype to send (may be a strided view)
        self.dim = dim
        self.group = group
        self.tp = tp
        self.name = name
        self.timeout_s = timeout_s
        self.dtype = piece.dtype
        shape = list(piece.shape)
        shape[dim] *= tp
        self.shape = tuple(shape)
        self.scratch_bytes = self.nbytes

    @property
    def device(self) -> torch.device:
        return self.piece.device

    def write_into(self, dest: torch.Tensor) -> None:
        out = dest[: self.nbytes].view(self.dtype).view(self.shape)
        with torch.no_grad():
            if self.tp == 1:
                out.copy_(self.piece)
            elif self.dim == 0 and out.device == self.piece.device:
                self._all_gather(out, self.piece.contiguous())
            else:
                out.copy_(self._gathered())

    def materialize(self) -> torch.Tensor:
        with torch.no_grad():
            return self.piece.clone() if self.tp == 1 else self._gathered()

    def _gathered(self) -> torch.Tensor:
        """The whole tensor, gathered rank-major and then laid out as the HF tensor."""
        rows, *rest = self.piece.shape
        # gloo wants the output [tp * rows, ...], rank after rank; viewed [tp, rows, ...] after
        flat = torch.empty((self.tp * rows, *rest), dtype=self.dtype, device=self.piece.device)
        self._all_gather(flat, self.piece.contiguous())
        rank_major = flat.view(self.tp, rows, *rest)
        if self.dim == 0:
            return rank_major.reshape(self.shape)
        # [tp, rows, cols/tp] -> [rows, tp, cols/tp] -> [rows, cols]
        return rank_major.movedim(0, 1).reshape(self.shape)

    def _all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        work = _ALL_GATHER(out, local, group=self.group, async_op=True)
        if work is None:
            raise TransferError(f"weight {self.name!r}: this rank is not in its TP group")
        if self.timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=self.timeout_s))


def lent_weights(
    parameters: dict[str, torch.Tensor],
    params: list[Mapped],
    geometry: Geometry,
    *,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
    timeout_s: float | None = None,
) -> Iterator[tuple[str, LentTensor | torch.Tensor]]:
    """(HF name, weight) of every HF tensor of the model, in `params`' order: a TpGather for a
    split tensor, a detached tensor for a replicated one (cast to `dtype`). Nothing is
    gathered here: the sender gathers each as it packs it."""
    for param in params:
        local = parameters[param.megatron].detach()
        for name, piece in zip(param.hf, param.rule.pieces(local, geometry), strict=True):
            if param.rule.dim is None:
                yield name, piece.to(dtype)
                continue
            yield (
                name,
                TpGather(
                    piece.to(dtype),
                    dim=param.rule.dim,
                    group=group,
                    tp=geometry.tp,
                    name=name,
                    timeout_s=timeout_s,
                ),
            )
