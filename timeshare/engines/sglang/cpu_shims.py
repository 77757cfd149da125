"""SGLang's processes on a CPU-only torch: the two gaps of the PyPI packages, closed as patches.

SGLang 0.5.23 from PyPI is built for CUDA. On a CPU-only torch two of its imports fail:

- torchvision's compiled ops are built against a CUDA torch; without them, importing
  torchvision fails ("operator torchvision::nms does not exist") because its fake-tensor
  registrations expect `nms` and `qnms` to be defined. `TORCHVISION_OPS` defines their schemas
  (with kernels that raise naming this module if ever called: text models never do).
- SGLang's CPU engine imports `sgl_kernel`, whose CPU build is not on PyPI. `SGL_KERNEL_STANDIN`
  installs sgl_kernel_standin.py in its place.

Both are patches (engines/patches.py): each is needed only where torch is CPU-only and the real
package is missing or broken, so on a GPU install (a CUDA torch, the real `sgl_kernel`, a
matching torchvision) neither loads. Neither is applied up front: boot.py, in the processes of
the SGLang venv only, applies each as the package it stands in for is first imported.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from timeshare.engines.patches import Outcome, Patch, apply_patches
from timeshare.engines.sglang.op_library import OpLibrary, load_op_library, op_library

SHIM = "timeshare's torchvision shim (engines/sglang/cpu_shims.py)"
# The ops torchvision's fake-tensor registrations need defined (its _meta_registrations.py).
TORCHVISION_OPS_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_libraries: list[OpLibrary] = []  # kept alive: a dropped Library unregisters its ops


def cpu_only_torch() -> bool:
    """A torch built for no accelerator (the CPU build of PyPI's or this machine's wheel)."""
    return torch.version.cuda is None and torch.version.hip is None


def torchvision_lacks_ops() -> bool:
    """torch is CPU-only and torchvision is installed, but its compiled ops do not load on this
    torch (loading them is what tells: where they load, they are defined and nothing is due)."""
    if not cpu_only_torch() or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    extensions = sorted(Path(spec.submodule_search_locations[0]).glob("_C*.so"))
    if not extensions:
        return True
    try:
        load_op_library(str(extensions[0]))
    except (OSError, RuntimeError):
        return True
    return False


def define_torchvision_ops() -> None:
    library = op_library("torchvision", "DEF")
    for name, schema in TORCHVISION_OPS_SCHEMAS.items():
        library.define(schema)
        library.impl(name, _unavailable_op(name), "CompositeExplicitAutograd")
    _libraries.append(library)


def _unavailable_op(name: str) -> Callable[..., torch.Tensor]:
    def unavailable(*args: object) -> torch.Tensor:
        raise NotImplementedError(
            f"torchvision::{name} was called: {SHIM} defines its schema only, since "
            "torchvision's compiled ops need a CUDA torch; install a torchvision built for "
            "this torch to use it"
        )

    return unavailable


def sgl_kernel_missing() -> bool:
    """torch is CPU-only and no real `sgl_kernel` is installed (boot.py's import hook asks
    with itself out of the way)."""
    return cpu_only_torch() and importlib.util.find_spec("sgl_kernel") is None


def install_sgl_kernel_standin() -> None:
    from timeshare.engines.sglang import sgl_kernel_standin  # noqa: PLC0415

    sgl_kernel_standin.register_torch_ops()
    sys.modules["sgl_kernel"] = sgl_kernel_standin


TORCHVISION_OPS = Patch(
    name="sglang.torchvision_ops",
    version_of="torchvision",
    known=frozenset({"0.28.0"}),
    needed=torchvision_lacks_ops,
    apply=define_torchvision_ops,
    why="torchvision's compiled ops need a CUDA torch; its import fails without their schemas",
)
SGL_KERNEL_STANDIN = Patch(
    name="sglang.sgl_kernel_standin",
    version_of="sglang",
    known=frozenset({"0.5.23"}),
    needed=sgl_kernel_missing,
    apply=install_sgl_kernel_standin,
    why="SGLang's CPU engine imports sgl_kernel, whose CPU build is not on PyPI",
)
# The shim due when each package is first imported (boot.py's import hook).
SHIM_OF_PACKAGE = {"torchvision": TORCHVISION_OPS, "sgl_kernel": SGL_KERNEL_STANDIN}


def shim_before_import(package: str) -> Outcome:
    """Apply the shim of `package` if it is due (it is about to be imported)."""
    patch = SHIM_OF_PACKAGE[package]
    return apply_patches([patch])[patch.name]
