"""What runs first in every process of the SGLang venv: the CPU shims as their packages are
imported, and in SGLang's own processes the parent-death signal.

SGLang starts its scheduler and detokenizer with multiprocessing's spawn: fresh interpreters
that import SGLang (and so torchvision and `sgl_kernel`) before any code of ours could run in
them. The SGLang venv (the Makefile's .venv-sglang) carries `timeshare-sglang.pth`, which calls
`boot()` at interpreter start-up in each of its processes. `boot()` imports nothing heavy:

- it puts an import hook first on `sys.meta_path` that, as torchvision or `sgl_kernel` is first
  imported, applies its shim (cpu_shims.py) where it is due, and serves the `sgl_kernel`
  stand-in where no real one is installed. (transformers imports torchvision too: the trainer
  and the probes in that venv need its shim as much as SGLang does.)
- in the processes SGLang starts for a timeshare rollout worker (their environment names the
  worker, `HOST_PID_ENV`, set by engine.py while SGLang starts them), it arms the parent-death
  signal (`DIE_WITH_HOST`, die_with_host.py). Not in Python's resource tracker, which starts
  then too: it must outlive them all, to unlink the semaphores SGLang's processes shared
  (/dev/shm/sem.mp-*), and it exits once they are gone.

Processes of other venvs never load any of it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

HOST_PID_ENV = "TS_SGLANG_HOST_PID"  # not TIMESHARE_*: those are the job config's overrides


class ShimOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Applies a package's CPU shim as the package is first imported; serves the `sgl_kernel`
    stand-in when the shim installed it."""

    def __init__(self) -> None:
        self._busy = False  # while a shim's own checks look packages up

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if self._busy or fullname not in ("torchvision", "sgl_kernel"):
            return None
        from timeshare.engines.sglang.cpu_shims import shim_before_import  # noqa: PLC0415

        self._busy = True
        try:
            shim_before_import(fullname)
        finally:
            self._busy = False
        standin = sys.modules.get(fullname)
        if standin is None:
            return None  # the real package: the usual finders import it
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return sys.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        """The stand-in was executed when the shim imported it."""


def _is_resource_tracker() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            return b"multiprocessing.resource_tracker" in cmdline.read()
    except OSError:
        return False


def boot() -> None:
    if not any(isinstance(finder, ShimOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, ShimOnImport())
    host = os.environ.get(HOST_PID_ENV)
    if host is not None and host != str(os.getpid()) and not _is_resource_tracker():
        from timeshare.engines.patches import apply_patches  # noqa: PLC0415
        from timeshare.engines.sglang.die_with_host import DIE_WITH_HOST  # noqa: PLC0415

        apply_patches([DIE_WITH_HOST])
