"""Patches to engines we do not own: checked against what they were written for, applied once,
refused loudly on a target they do not know, switchable; against the real vLLM installed here
and against deliberately mismatched targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines import patch_target
from timeshare.engines.patches import (
    SWITCH_ENV,
    Outcome,
    Patch,
    apply_patches,
    source_fingerprint,
)
from timeshare.engines.registry import load_function
from timeshare.errors import PatchRefused

ROOT = Path(__file__).resolve().parents[2]
TARGET = "tests.engines.patch_target:greet"
ORIGINAL = patch_target.greet


@pytest.fixture(autouse=True)
def original_target() -> Iterator[None]:
    yield
    patch_target.greet = ORIGINAL


def replace_greet() -> None:
    def greet(name: str) -> str:
        return f"hello {name}, patched"

    patch_target.greet = greet


def greeting_patch(
    name: str, known: frozenset[str] | None = None, fixed: frozenset[str] = frozenset()
) -> Patch:
    """A patch of `greet`, written for its source as it is (unless `known` says otherwise)."""
    if known is None:
        known = frozenset({source_fingerprint(ORIGINAL)})
    return Patch(name=name, apply=replace_greet, known=known, fixed=fixed, source_of=TARGET)


def test_a_known_source_is_patched_once() -> None:
    patch = greeting_patch("greet.once")
    assert apply_patches([patch], environ={}) == {"greet.once": Outcome.APPLIED}
    assert patch_target.greet("ada") == "hello ada, patched"
    assert load_function(TARGET) is patch_target.greet
    assert apply_patches([patch], environ={}) == {"greet.once": Outcome.ALREADY}


def test_an_unknown_source_refuses_every_patch_before_any_is_applied() -> None:
    good = greeting_patch("greet.good")
    stale = greeting_patch("greet.stale", known=frozenset({"0123456789abcdef"}))
    with pytest.raises(PatchRefused) as refused:
        apply_patches([good, stale], environ={})
    message = str(refused.value)
    assert f"patch greet.stale: {TARGET} is {source_fingerprint(ORIGINAL)}" in message
    assert "it knows ['0123456789abcdef']" in message and f"{SWITCH_ENV}=greet.stale" in message
    assert patch_target.greet is ORIGINAL  # the known one was not applied either


def test_fixed_upstream_is_skipped_and_a_switched_off_patch_is_left_alone() -> None:
    fixed = greeting_patch(
        "greet.fixed", known=frozenset(), fixed=frozenset({source_fingerprint(ORIGINAL)})
    )
    off = greeting_patch("greet.off")
    outcomes = apply_patches([fixed, off], environ={SWITCH_ENV: "greet.off, other"})
    assert outcomes == {"greet.fixed": Outcome.SKIPPED, "greet.off": Outcome.DISABLED}
    assert apply_patches([off], environ={SWITCH_ENV: "all"}) == {"greet.off": Outcome.DISABLED}
    assert patch_target.greet is ORIGINAL


def test_a_patch_names_one_target() -> None:
    with pytest.raises(ValueError, match="name one target"):
        Patch(name="x", apply=replace_greet, known=frozenset(), version_of="a", source_of=TARGET)


# In a process of its own, as vLLM's: the plugin's patch against the vLLM installed here.
VLLM_SCRIPT = """
import ctypes, dataclasses, json, os, sys
from timeshare.engines.vllm import plugin
from timeshare.engines.patches import apply_patches
from timeshare.errors import PatchRefused

def pdeathsig():
    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value))  # PR_GET_PDEATHSIG
    return value.value

seen = {"before": pdeathsig()}
os.environ[plugin.HOST_PID_ENV] = str(os.getppid())
plugin.register()
seen["after"] = pdeathsig()
seen["again"] = apply_patches([plugin.DIE_WITH_HOST])["vllm.die_with_host"].value
stale = dataclasses.replace(plugin.DIE_WITH_HOST, name="vllm.stale", known=frozenset({"0.0.1"}))
try:
    apply_patches([stale])
except PatchRefused as exc:
    seen["stale"] = str(exc)
print(json.dumps(seen))
"""


def run_in_a_process(environ: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
        env=environ,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return seen


@pytest.mark.slow
def test_the_vllm_plugin_arms_the_parent_death_signal_through_a_patch_it_checks() -> None:

    environ = {k: v for k, v in os.environ.items() if k != SWITCH_ENV}
    seen = run_in_a_process(environ)
    assert (seen["before"], seen["after"]) == (0, 9)  # SIGKILL when the parent dies
    assert seen["again"] == "already applied"
    assert "patch vllm.stale: vllm is 0.32.0, which it was not written for" in str(seen["stale"])
    off = run_in_a_process({**environ, SWITCH_ENV: "vllm.die_with_host"})
    assert (off["before"], off["after"]) == (0, 0)
    assert off["again"] == "disabled"
