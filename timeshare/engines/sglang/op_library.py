"""torch.library as our CPU stand-ins use it (cpu_shims.py, sgl_kernel_standin.py), typed:
torch's own stubs leave `Library` and `torch.ops.load_library` unannotated, so each call of
theirs would need a `type: ignore`; here there is one per function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class OpLibrary(Protocol):
    """What of `torch.library.Library` we call: define an op's schema, register a kernel."""

    def define(self, schema: str) -> object: ...

    def impl(self, name: str, fn: Callable[..., torch.Tensor], dispatch_key: str) -> object: ...


def op_library(namespace: str, kind: str) -> OpLibrary:
    """`torch.library.Library(namespace, kind)`; kind "DEF" (a namespace of ours) or
    "FRAGMENT" (ops added to one that may exist). Keep it alive while its ops are in use."""
    library: OpLibrary = torch.library.Library(namespace, kind)  # type: ignore[no-untyped-call]  # torch's Library.__init__ is unannotated
    return library


def load_op_library(path: str) -> None:
    """Load a shared library of compiled ops (it registers them as it loads)."""
    torch.ops.load_library(path)  # type: ignore[no-untyped-call]  # torch's _Ops.load_library is unannotated
