"""docs/internals.md's op table, made from the ops' own semantics rules
(``dcpc.lang.semantics.describe``) over the per-op conformance files schedules/ops/:
one row per distinct form of each op, with the first step that shows it.

    PYTHONPATH=. python tests/support/op_table.py     # prints the table
"""

from __future__ import annotations

from pathlib import Path

from dcpc.diagnostics import DiagnosticError
from dcpc.lang.parse import parse_file
from dcpc.lang.semantics import describe, table
from dcpc.ops import OPS

ROOT = Path(__file__).resolve().parents[2]
HEAD = ("| op | before its signal | after its wait | sync | first shown by |\n"
        "| --- | --- | --- | --- | --- |\n")


def rows() -> list[str]:
    seen: dict[tuple[str, str, str, str], str] = {}
    for path in sorted((ROOT / "schedules" / "ops").glob("*.yaml")):
        try:
            schedule = parse_file(path)
        except DiagnosticError:  # a file whose loops name W: its steps at W=4
            schedule = parse_file(path, world=4)
        for step, sem in zip(schedule.step_list(), table(schedule), strict=True):
            if step.kind != "external":
                seen.setdefault((step.kind, *describe(sem)), f"{path.name}: {step.name}")
    order = list(OPS)
    return [f"| {op} | {before} | {after} | {sync} | {where} |"
            for (op, before, after, sync), where in sorted(
                seen.items(), key=lambda kv: (order.index(kv[0][0]), kv[1]))]


def text() -> str:
    return HEAD + "\n".join(rows()) + "\n"


if __name__ == "__main__":
    print(text(), end="")
