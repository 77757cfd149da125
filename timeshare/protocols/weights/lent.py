"""A weight that writes itself into staging: the sender lends it the bytes, it fills them.

A sharded trainer (FSDP2) holds each parameter in pieces across ranks. Sent as a plain tensor it
costs two copies: an all-gather into a fresh full tensor, then the sender's copy into staging. A
`LentTensor` is handed the staging bytes instead (`write_into`), so that the gather writes there
and is the only copy. The receiver cannot tell the difference: the wire says the tensor's dtype,
shape and bytes, as for any tensor.

`write_into` may run collectives, so every rank must call it in the same order: the sender calls
it in the order the items came in, in a worker thread (a collective blocks), never on the event
loop. A collective must have a deadline of its own (the process group's timeout, or one passed to
the gather): the sender cannot abandon a thread that writes into its staging.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch


class LentTensor(ABC):
    """A tensor that writes itself into the staging the sender lends it (e.g. an all-gather
    whose output is staging)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    # Bytes write_into may touch, >= nbytes: a gather may write padding after the tensor. The
    # sender reserves all of them, so padding never lands on another piece.
    scratch_bytes: int

    @property
    def device(self) -> torch.device:
        """Where its bytes come from ("auto" transport stages on a CUDA one: transport.py)."""
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor itself (what goes on the wire)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @abstractmethod
    def write_into(self, dest: torch.Tensor) -> None:
        """Fill dest[:nbytes] with the tensor's bytes, row-major; dest is a flat uint8 CPU (or
        staging-device) tensor of scratch_bytes. May run collectives: every rank calls it in the
        same order."""

    @abstractmethod
    def materialize(self) -> torch.Tensor:
        """The whole tensor, as an owned tensor (used when it cannot be written into one
        bucket). May run collectives, as write_into may."""
