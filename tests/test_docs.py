"""The users' docs stay true: every error class the tests exercise is documented."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_malformed_class_is_in_the_language_reference():
    documented = set(re.findall(r"`([a-z][a-z0-9-]+)`", (ROOT / "docs/language.md").read_text()))
    classes = {
        path.read_bytes().splitlines()[0].decode().split()[2]
        for path in (ROOT / "tests/malformed").glob("*.yaml")
    }
    assert len(classes) >= 30
    assert classes <= documented, sorted(classes - documented)


def test_readme_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    test_command = next(line.strip() for line in readme.splitlines() if "pytest" in line)
    assert test_command in ci
