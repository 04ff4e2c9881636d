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


def test_the_ops_that_take_axis_are_the_registry_s_team_ops():
    """docs/language.md said every communication op takes `axis:` (issue 33): it lists
    the ops whose OpDef.teams is set, and no other."""
    from dcpc.check.mesh import team_ops

    text = (ROOT / "docs/language.md").read_text()
    start = text.index("- These communication ops take `axis:`")
    listed = text[start:text.index("(the ops whose `OpDef.teams` is set", start)]
    names = re.findall(r"`([a-z_]+)`( \(with `dim`\))?", listed.split(":", 1)[1])
    assert [n + (" (dim)" if dim else "") for n, dim in names] == team_ops()
