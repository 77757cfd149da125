"""vLLM's entry point into timeshare (`vllm.general_plugins`), run in every process vLLM starts.

vLLM calls `register()` in the process that makes the `LLM`, in `VLLM::EngineCore` and in each
`VLLM::Worker` before it loads the model. It does two things there:

- registers the `timeshare` weight-transfer backend (backend.py), once per process;
- in the processes vLLM starts for a timeshare rollout worker (their environment names the
  worker's pid, `HOST_PID_ENV`), arms the parent-death signal, so that EngineCore dies with the
  rollout worker and each vLLM worker with its EngineCore, however its parent died (SIGKILL
  included). vLLM itself leaves them running, orphaned, holding the device. This changes how
  vLLM's processes behave, so it is a patch (engines/patches.py): written for the vLLM versions
  in `DIE_WITH_HOST.known`, refused loudly on any other, switchable with TS_PATCHES_OFF.
"""

from __future__ import annotations

import os

from timeshare.engines.patches import Patch, apply_patches
from timeshare.runtime import die_with_parent
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "timeshare"
# Not TIMESHARE_*: those are the job config's overrides.
HOST_PID_ENV = "TS_VLLM_HOST_PID"


DIE_WITH_HOST = Patch(
    name="vllm.die_with_host",
    version_of="vllm",
    known=frozenset({"0.32.0"}),
    apply=die_with_parent,
    why="vLLM leaves EngineCore and its workers running, orphaned, when their parent dies",
)


def register() -> None:
    host = os.environ.get(HOST_PID_ENV)
    if host is not None and host != str(os.getpid()):
        apply_patches([DIE_WITH_HOST])
    _register_backend()


def _register_backend() -> None:
    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "timeshare.engines.vllm.backend", "TimeshareWeightTransfer"
        )
    except ValueError:
        # vLLM may call its plugins more than once in a process; the backend stays registered.
        if BACKEND not in WeightTransferEngineFactory._registry:
            raise
