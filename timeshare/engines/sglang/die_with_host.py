"""SGLang's processes die with the rollout worker that started them, however it died.

SGLang's scheduler and detokenizer watch their parent only while their own loop runs; a parent
killed with SIGKILL while they start, load or sit in a collective leaves them running, holding
memory and shared segments. `DIE_WITH_HOST` arms Linux's parent-death signal in each of them
at interpreter start-up (boot.py), before SGLang's code runs. It changes how SGLang's processes
behave, so it is a patch (engines/patches.py): written for the SGLang versions in `known`.
"""

from __future__ import annotations

from timeshare.engines.patches import Patch
from timeshare.runtime import die_with_parent

DIE_WITH_HOST = Patch(
    name="sglang.die_with_host",
    version_of="sglang",
    known=frozenset({"0.5.23"}),
    apply=die_with_parent,
    why="SGLang's processes outlive a rollout worker killed before their own watch runs",
)
