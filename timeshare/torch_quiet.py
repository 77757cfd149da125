"""The driver's stderr without torch's C++ warnings, which TCPStore writes with a whole stack
trace for each call that finds a peer gone (a follower's beat, every time, once the leader's
store is gone).

The driver says itself, in one log line naming the node, what losing the store or a node means
(cycle/nodes.py, protocols/nodes.py). c10 reads TORCH_CPP_LOG_LEVEL once, as torch loads: the
fronts' package (timeshare/daemon/) calls `quiet_this_process` as it is imported, before
anything imports torch. A value the user set is kept, and the workers, whose engines' own C++
warnings are theirs to see, are given back whatever the user had (`as_the_user_had_it`).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VARIABLE = "TORCH_CPP_LOG_LEVEL"
_quieted = False
_users: str | None = None  # what the user had set, once quieted


def quiet_this_process() -> None:
    """torch's C++ warnings off this process's stderr (errors still show), unless the user chose
    a level; call before torch loads."""
    global _quieted, _users
    if not _quieted:
        _quieted, _users = True, os.environ.get(VARIABLE)
        os.environ.setdefault(VARIABLE, "ERROR")


def as_the_user_had_it(environ: MutableMapping[str, str]) -> None:
    """`environ` (a worker's, from this process's) with TORCH_CPP_LOG_LEVEL as the user had it."""
    if not _quieted:
        return
    if _users is None:
        environ.pop(VARIABLE, None)
    else:
        environ[VARIABLE] = _users
