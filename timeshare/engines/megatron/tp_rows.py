"""The rows a tensor-parallel group computes on: the batches of all its ranks.

Each rank's rollout samples its own prompts, but the ranks of a TP group run one model between
them and must see the same rows. So every rank's batch is all-gathered over the TP group. For
training the rows are laid out minibatch-major: the group's minibatch m is each rank's
minibatch m, rank by rank, so that an optimiser step sees the same samples whatever the split
between tensor and data parallelism (TP=2 over two ranks, or two data-parallel replicas, each
step m on both ranks' minibatch m).

    rank 0: [a0 a1 | a2 a3]      group rows: [a0 a1 b0 b1 | a2 a3 b2 b3]
    rank 1: [b0 b1 | b2 b3]      (two minibatches)

Samples differ in length, and so do the ranks' batches (sequences.py's layout: each as wide as
its longest row): before a gather every rank pads its batch to the widths of the group's widest
(`padded`), which padding cannot change (right padding, causal attention).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from timeshare.engines.megatron.parallel import Layout
from timeshare.engines.sequences import Sequences
from timeshare.errors import TimeshareError

SHAPE_SLOTS = 32  # numbers describing a batch's shapes (more when it takes more)


class TpRows:
    def __init__(self, layout: Layout, minibatches: int) -> None:
        self.layout = layout
        self.minibatches = minibatches

    @property
    def tp(self) -> int:
        return self.layout.tp

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor ([rows, ...], the same rows on every rank) as the group's rows,
        minibatch-major."""
        out = []
        for rank_major in self._gathered(tensors):
            tp, rows = rank_major.shape[:2]
            per_minibatch = rank_major.view(tp, self.minibatches, rows // self.minibatches, -1)
            out.append(per_minibatch.transpose(0, 1).reshape(tp * rows, *rank_major.shape[2:]))
        return out

    def padded(self, sequences: Sequences, device: torch.device) -> Sequences:
        """`sequences` padded to the widths of the group's widest batch (a collective: every
        rank of the group calls it with its own batch)."""
        if self.tp == 1:
            return sequences
        widths = torch.tensor(sequences.widths, dtype=torch.int64, device=device)
        dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=self.layout.tp_group)
        width, completion_width = (int(w) for w in widths.tolist())
        return sequences.padded(width, completion_width)

    def minibatch_rows(self, rank_rows: int) -> int:
        """The rows of one of the group's minibatches when each rank has `rank_rows`: each
        rank's minibatch, side by side."""
        return self.tp * (rank_rows // self.minibatches)

    def minibatch(self, rows: range) -> range:
        """The group's rows of the minibatch whose rows of this rank are `rows`."""
        size = len(rows)
        index = rows.start // size
        return range(index * size * self.tp, (index + 1) * size * self.tp)

    def gather_plain(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor as the group's rows, rank after rank."""
        return [t.reshape(-1, *t.shape[2:]) for t in self._gathered(tensors)]

    def own_plain(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `values` laid out by `gather_plain`."""
        rows = len(values) // self.tp
        return values[self.layout.tp_rank * rows : (self.layout.tp_rank + 1) * rows]

    def _gathered(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor of every TP rank, stacked rank-major: [tp, rows, ...]."""
        if self.tp == 1:
            return [t.unsqueeze(0) for t in tensors]
        self._check_shapes(tensors)
        group = self.layout.tp_group
        out = []
        for tensor in tensors:
            # gloo wants the output [tp * rows, ...]; viewed [tp, rows, ...] after
            flat = tensor.new_empty((self.tp * tensor.shape[0], *tensor.shape[1:]))
            dist.all_gather_into_tensor(flat, tensor.contiguous(), group=group)
            out.append(flat.view(self.tp, *tensor.shape))
        return out

    def _check_shapes(self, tensors: list[torch.Tensor]) -> None:
        """Every rank of the group holds tensors of the same shapes (a collective)."""
        described = [d for t in tensors for d in (t.dim(), *t.shape)]
        slots = max(SHAPE_SLOTS, len(described))
        mine = torch.full((slots,), -1, dtype=torch.int64, device=tensors[0].device)
        mine[: len(described)] = torch.tensor(described, device=mine.device)
        theirs = mine.new_empty((self.tp * len(mine),))
        dist.all_gather_into_tensor(theirs, mine, group=self.layout.tp_group)
        theirs = theirs.view(self.tp, len(mine))
        if not bool((theirs == mine).all()):
            raise TimeshareError(
                f"the ranks of tensor-parallel group {self.layout.dp_rank} hold batches of "
                f"different shapes ({[t.shape for t in tensors]} on rank {self.layout.rank}): "
                "they train on their rows together, which must be alike"
            )
