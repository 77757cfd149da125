"""SGLang's entry point into timeshare (`sglang.srt.plugins`), run in every process SGLang starts.

SGLang loads its general plugins early in its engine, scheduler and detokenizer processes. In
those of a timeshare rollout worker (their environment names it, boot.HOST_PID_ENV) this applies
`DIE_WITH_HOST` (already applied at interpreter start where the SGLang venv's .pth runs boot.py:
this covers an install without it, a GPU one), `SEEDED_SAMPLING` (seeded_sampling.py: a
request's seed is honoured whatever the attention backend) and `REQUEST_STOPS`
(request_stops.py: a request stops at its own stop tokens, not at the model's EOS besides), and
closes timeshare's weight receivers when the process exits. Elsewhere it does nothing: an SGLang
of the same venv that timeshare did not start is left as it is.
"""

from __future__ import annotations

import atexit
import os

from timeshare.engines.sglang.boot import HOST_PID_ENV


def register() -> None:
    host = os.environ.get(HOST_PID_ENV)
    if host is None or host == str(os.getpid()):
        return
    from timeshare.engines.patches import apply_patches  # noqa: PLC0415
    from timeshare.engines.sglang.die_with_host import DIE_WITH_HOST  # noqa: PLC0415
    from timeshare.engines.sglang.loader import close_all  # noqa: PLC0415
    from timeshare.engines.sglang.request_stops import REQUEST_STOPS  # noqa: PLC0415
    from timeshare.engines.sglang.seeded_sampling import SEEDED_SAMPLING  # noqa: PLC0415

    apply_patches([DIE_WITH_HOST, SEEDED_SAMPLING, REQUEST_STOPS])
    atexit.register(close_all)
