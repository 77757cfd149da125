"""The digest behind `weights_match`: equal iff two sets of named weights agree bit for bit.

Each tensor is hashed as it passes (as buckets arrive, in any order) with XXH3-128 (`xxhash`),
which runs at about twice memcpy speed on this machine's CPU (24 GB/s against sha256's 1.7 GB/s;
`benchmarks/digest.py` measures the candidates), so checking every step costs a few percent of
a SYNC instead of half of it. The digest of a version is XXH3-128 over the sorted lines
"name|dtype|shape|hash of the bytes".

What it guarantees: a non-cryptographic hash catches corruption, torn or stale buckets, a
tensor under the wrong name, dtype or shape, and any mix-up of versions, with the odds of a
miss about 2^-128 per comparison. It does not stand against an adversary who crafts colliding
weights; nothing on timeshare's sockets is trusted against one anyway (they are local and owned
by the job's user).

Tensors are hashed in host memory: where the bytes already are on every path here (the
trainer's CPU tensors, host staging on both ends). A device tensor is copied to the host first.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import torch
import xxhash

ALGORITHM = "xxh3-128"


def tensor_hash(tensor: torch.Tensor) -> str:
    """XXH3-128 of `tensor`'s bytes in row-major order (hex)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    # The bytes read in place through ctypes, not `.numpy()`: a tensor once exported to numpy
    # has its storage marked not resizable for good, and OFFLOAD frees a parameter's storage by
    # resizing it (host_memory.py): hashing a trainer's own parameter must leave it as it was.
    # `data` holds the storage while the hash reads it.
    bytes_ = (ctypes.c_char * (data.numel() * data.element_size())).from_address(data.data_ptr())
    return xxhash.xxh3_128_hexdigest(bytes_)


class WeightsDigest:
    """A digest of named weights fed one tensor at a time, in any order (as buckets arrive).

    Equal iff every name, dtype, shape and byte agrees. `add` may be called from several
    threads at once (one dict store per tensor).
    """

    def __init__(self) -> None:
        self._tensors: dict[str, str] = {}  # name -> "dtype|shape|hash of the bytes"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._tensors[name] = f"{tensor.dtype}|{tuple(tensor.shape)}|{tensor_hash(tensor)}"

    def hexdigest(self) -> str:
        digest = xxhash.xxh3_128()
        for name in sorted(self._tensors):
            digest.update(f"{name}|{self._tensors[name]}\n".encode())
        return f"{ALGORITHM}:{digest.hexdigest()}"

    def table(self) -> dict[str, str]:
        """Each tensor's line, by name ("dtype|shape|hash of the bytes"): what the digest is
        of, kept by both sides of a transfer so that a mismatch can name the first tensor that
        differs (state/weights.py `tensor_difference`)."""
        return dict(self._tensors)


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The `WeightsDigest` of all of `named`: equal iff the weights are equal."""
    return digest_of(named).hexdigest()


def digest_of(named: Iterable[tuple[str, torch.Tensor]]) -> WeightsDigest:
    """A `WeightsDigest` fed all of `named`."""
    digest = WeightsDigest()
    for name, tensor in named:
        digest.add(name, tensor)
    return digest
