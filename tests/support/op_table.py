"""docs/language.md's generated op table ("What each op reads, writes and
synchronises"), made from the ops' own semantics rules (``dcpc.lang.semantics.describe``)
over the per-op conformance files schedules/ops/: one row per distinct form of each op,
with the first step that shows it. An op's docs live in that one file, so a new op
touches docs/language.md and not docs/internals.md.

    PYTHONPATH=. python tests/support/op_table.py          # prints the table
    PYTHONPATH=. python tests/support/op_table.py --write  # rewrites it in language.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from dcpc.diagnostics import DiagnosticError
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file
from dcpc.lang.semantics import describe, table
from dcpc.ops import OPS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "language.md"
START, END = "<!-- op table: generated -->\n", "<!-- op table: end -->"
HEAD = ("| op | before its signal | after its wait | sync | first shown by |\n"
        "| --- | --- | --- | --- | --- |\n")


def rows() -> list[str]:
    seen: dict[tuple[str, str, str, str], str] = {}
    for path in sorted((ROOT / "schedules" / "ops").glob("*.yaml")):
        try:
            schedule = parse_file(path)
        except DiagnosticError:  # a file whose loops name W: its steps at W=4 (2x2)
            try:
                schedule = parse_file(path, world=4)
            except DiagnosticError:  # one whose perm runs along an axis: at a shape
                schedule = parse_file(path, world=MeshWorld((2, 2)))
        for step, sem in zip(schedule.step_list(), table(schedule), strict=True):
            if step.kind != "external":
                seen.setdefault((step.kind, *describe(sem)), f"{path.name}: {step.name}")
    order = list(OPS)
    return [f"| {op} | {before} | {after} | {sync} | {where} |"
            for (op, before, after, sync), where in sorted(
                seen.items(), key=lambda kv: (order.index(kv[0][0]), kv[1]))]


def text() -> str:
    return HEAD + "\n".join(rows()) + "\n"


def shown(doc: str) -> str:
    """The table as docs/language.md holds it (between its two markers)."""
    if START not in doc or END not in doc:
        raise ValueError(f"{DOC}: no {START.strip()} ... {END} block")
    return doc[doc.index(START) + len(START):doc.index(END)]


def write() -> None:
    """Rewrite the table in docs/language.md from the ops' rules."""
    doc = DOC.read_text()
    shown(doc)  # both markers present
    DOC.write_text(doc[:doc.index(START) + len(START)] + text() + doc[doc.index(END):])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(text(), end="")
