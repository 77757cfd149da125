"""Staging buffers of the weight channel: the one interface every transport implements.

The sender creates staging and describes it in the handshake (`describe`); the receiver maps
that description (transport.py picks the implementation); once it has, the sender removes every name
the staging had (`unlink_names`), so that nothing is left to sweep. Both sides then see the same
bytes, and every later transfer of the session reuses them.

Implementations: shm.py (/dev/shm segments) and cuda_ipc.py (buffers on the sender's GPU,
shared by handle), each with its own description struct in descriptions.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import structlog
import torch

from timeshare.protocols.weights.descriptions import StagingDescription

log = structlog.get_logger(__name__)


class Staging(ABC):
    """Equal buffers both processes map; `buffers[i]` is a flat uint8 tensor over buffer i."""

    buffer_bytes: int
    buffers: list[torch.Tensor]

    @abstractmethod
    def describe(self) -> StagingDescription:
        """What the receiver needs to map the same buffers (sent in the handshake)."""

    @abstractmethod
    def unlink_names(self) -> None:
        """Remove every name the buffers have; the memory lives on while mapped."""

    @abstractmethod
    def view(self, index: int) -> tuple[torch.Tensor, torch.UntypedStorage]:
        """A fresh tensor over buffer `index` and its storage (see `views_alive`)."""

    def kept_views(self, storage: torch.UntypedStorage) -> int:
        """How many views of a `view`'s storage something other than this staging still holds
        (0: nothing kept one). An implementation that holds the storage itself says so here."""
        return views_alive(storage)

    @abstractmethod
    def start_fault_in(self) -> None:
        """The sender, once the handshake is over: start setting every buffer up for use (its
        pages faulted in) in the background; `ready` waits for one."""

    @abstractmethod
    def is_ready(self, index: int) -> bool:
        """Whether buffer `index` can be used without waiting (see `ready`)."""

    @abstractmethod
    def ready(self, index: int) -> None:
        """Wait (bounded) until buffer `index` is set up for use (`start_fault_in`). Blocking:
        call it off the event loop."""

    @abstractmethod
    def close(self) -> None:
        """Release the mappings; never unmaps memory a live tensor still views."""


_use_count = getattr(torch._C, "_storage_Use_Count", None)
if _use_count is None:  # pragma: no cover - depends on the torch build
    log.warning("staging.view_check.unavailable", torch=torch.__version__)


def views_alive(storage: torch.UntypedStorage) -> int:
    """How many references other than `storage` itself still hold it (0: no view is left).

    A view of a view counts its base too, so this is not the number of tensors a caller kept.
    Returns 0 where this torch build cannot tell.
    """
    if _use_count is None:  # pragma: no cover
        return 0
    return int(_use_count(storage._cdata)) - 1
