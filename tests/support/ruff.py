"""How the tests run ruff over generated code: the project's rules, no project config."""

from __future__ import annotations

import sys

RUFF = [sys.executable, "-m", "ruff"]
RUFF_CONFIG = [
    "--config",
    "line-length = 100",
    "--config",
    "target-version = 'py310'",
    "--config",
    "lint.select = ['E', 'F', 'W', 'I', 'B', 'UP']",
    "--config",
    "lint.isort.known-third-party = ['dcpc']",
]
