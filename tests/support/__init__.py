"""Helpers the test modules share (tests/ is on the path: ``from support.x import y``).

The tests are grouped by the stage they test (lang, check, codegen, ops, run, runtime,
engines, cli); the data they read (hb_corpus/, gallery_twins/, ...) stays in tests/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a test module run as a script in a child process: tests/ on
    ``PYTHONPATH`` (a script's own folder is its path, and it imports ``support``)."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def child_result(script: str, *args: str) -> Any:
    """Run test module ``script`` as a script in a child process (the Triton interpreter,
    one thread; a loaded machine gets 300 s) and return what its last ``RESULT <json>``
    line says; the child's output in the failure when it printed none."""
    env = script_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])
