"""Helpers the test modules share (tests/ is on the path: ``from support.x import y``).

The tests are grouped by the stage they test (lang, check, codegen, ops, run, runtime,
engines, cli); the data they read (hb_corpus/, gallery_twins/, ...) stays in tests/."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a test module run as a script in a child process: tests/ on
    ``PYTHONPATH`` (a script's own folder is its path, and it imports ``support``)."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
