"""A function a test patches, as timeshare patches an engine's (test_patches.py)."""

from __future__ import annotations


def greet(name: str) -> str:
    return f"hello {name}"
