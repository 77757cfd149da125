"""FSDP2 parameters as LentTensors: each all-gather writes straight into the weight channel's
staging, so that gathering a parameter is the only copy the trainer makes of it.

A parameter of a `fully_shard`-ed module is a DTensor sharded `Shard(0)` over a 1-D mesh: rank r
holds rows [r*k, (r+1)*k) of the full tensor, k = ceil(dim0 / world), as an unpadded chunk (the
last ranks' may be short or empty). `all_gather_single` wants equal inputs, so each rank pads its
chunk to k rows; the output, world*k rows, then starts with the full tensor, and the padding rows
after it are the scratch the sender reserved (`scratch_bytes`).

Every rank must gather the same parameters in the same order: iterate `lent_parameters` on every
rank and hand each to its own sender with the same bucket size. `gathered_parameters` is the
other way (`sync_gather = "then_pack"`): each gathered into a fresh tensor as it is asked for.

Names are the transformers names (`model.layers.0.self_attn.q_proj.weight`): `fully_shard` keeps
every name. A tied head is the embedding's parameter, which `named_parameters` yields once as
`model.embed_tokens.weight`: what vLLM's and the reference rollout's loaders expect of a tied
model (they skip `lm_head.weight`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from timeshare.errors import TransferError
from timeshare.protocols.weights.lent import LentTensor


class ShardGather(LentTensor):
    """One FSDP2 parameter, all-gathered into the staging the sender lends it.

    `dtype` casts the local shard before the gather (fp32 master weights sent as bf16): the
    gather then moves and writes the rollout's dtype. `timeout_s` bounds the gather (RuntimeError
    of the process group's backend past it); None leaves the process group's own timeout.
    """

    def __init__(
        self,
        parameter: DTensor,
        *,
        dtype: torch.dtype | None = None,
        name: str = "parameter",
        timeout_s: float | None = None,
    ) -> None:
        _check_sharding(parameter, name)
        self.parameter = parameter
        self.name = name
        self.timeout_s = timeout_s
        self.dtype = dtype if dtype is not None else parameter.dtype
        self.shape = tuple(parameter.shape)
        self.world = parameter.device_mesh.size()
        self.rows_per_rank = -(-self.shape[0] // self.world)  # ceil
        self.scratch_bytes = self.world * self.rows_per_rank * self._row_bytes

    @property
    def _row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self.parameter.device

    def write_into(self, dest: torch.Tensor) -> None:
        if self.scratch_bytes == 0:  # dim0 == 0 on every rank alike: nothing to gather
            return
        gathered_shape = (self.world * self.rows_per_rank, *self.shape[1:])
        out = dest[: self.scratch_bytes].view(self.dtype).view(gathered_shape)
        with torch.no_grad():  # to_local() views a leaf that requires grad
            local = self._padded_local()
            if out.device == local.device:
                self._all_gather(out, local)
            else:  # staging elsewhere (a CPU gather for device staging): gather, then copy
                near = torch.empty(gathered_shape, dtype=self.dtype, device=local.device)
                self._all_gather(near, local)
                out.copy_(near)

    def materialize(self) -> torch.Tensor:
        with torch.no_grad():
            cast = self.parameter.to(self.dtype)  # before the gather: it moves fewer bytes
            assert isinstance(cast, DTensor)
            full: torch.Tensor = cast.full_tensor()
            return full

    def _padded_local(self) -> torch.Tensor:
        """This rank's rows in `dtype`, padded to rows_per_rank (all_gather_single wants equal
        inputs); contiguous, as a collective's input must be."""
        local = self.parameter.to_local().to(self.dtype)
        if local.shape[0] == self.rows_per_rank:
            return local.contiguous()
        padded = local.new_zeros((self.rows_per_rank, *self.shape[1:]))
        padded[: local.shape[0]].copy_(local)
        return padded

    def _all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        group = self.parameter.device_mesh.get_group()
        work = _ALL_GATHER(out, local, group=group, async_op=True)
        if work is None:  # this rank is not in the group: it cannot be
            raise TransferError(f"weight {self.name!r}: this rank is not in its mesh's group")
        if self.timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=self.timeout_s))


# torch 2.13 names it all_gather_single and deprecates all_gather_into_tensor, which older
# torch builds (a GPU user's) have alone.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_sharding(parameter: DTensor, name: str) -> None:
    """Refuse what the padded gather cannot rebuild: anything but Shard(0) on a 1-D mesh."""
    placements = tuple(parameter.placements)
    if parameter.device_mesh.ndim != 1 or placements != (Shard(0),):
        raise TransferError(
            f"weight {name!r}: sharded {placements} on a {parameter.device_mesh.ndim}-D mesh; "
            "only Shard(0) on a 1-D mesh (FSDP2's fully_shard) can be gathered into staging"
        )


def lent_parameters(
    module: torch.nn.Module, *, dtype: torch.dtype | None = None, timeout_s: float | None = None
) -> Iterator[tuple[str, LentTensor | torch.Tensor]]:
    """(name, weight) of every parameter of a `fully_shard`-ed module, for `WeightSender.send`:
    a sharded parameter as a ShardGather, any other as its detached tensor (cast to `dtype` if
    given). Buffers are not parameters and are not yielded. Nothing is gathered here: the sender
    gathers each one as it packs it, so every rank must send the same items in the same order."""
    for name, parameter in module.named_parameters():
        if isinstance(parameter, DTensor):
            yield name, ShardGather(parameter, dtype=dtype, name=name, timeout_s=timeout_s)
        else:
            tensor = parameter.detach()
            yield name, tensor if dtype is None else tensor.to(dtype)


def gathered_parameters(
    module: torch.nn.Module, *, dtype: torch.dtype | None = None, timeout_s: float | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter, each gathered only when the consumer asks for it
    (collectives: every rank iterates, in the same order), so that the extra memory is what the
    consumer still holds (the weight channel: about one bucket), never the whole model."""
    for name, weight in lent_parameters(module, dtype=dtype, timeout_s=timeout_s):
        tensor = weight.materialize() if isinstance(weight, LentTensor) else weight
        del weight
        yield name, tensor
        del tensor  # not kept while the next one is gathered
