"""The users' docs stay true: every error class the tests exercise is documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
    # an op of which some forms take a team names them: `all_to_all` (with `dim` or ...)
    names = re.findall(r"`([a-z_]+)`(?: \(with ([^)]+)\))?", listed.split(":", 1)[1])
    forms = [(n, " ".join(form.replace("`", "").split())) for n, form in names]
    assert [n + (f" ({form})" if form else "") for n, form in forms] == team_ops()
    # it says these are every communication op: no op form runs over every axis only
    from dcpc.ops.registry import OPS

    assert "every communication op." in text[start:start + 600]
    assert not any(op.whole_mesh_form is not None for op in OPS.values())
    assert "The others run over every axis only" not in text
    # and no other doc says every communication op takes `axis:` without saying which
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for claim in re.finditer(r"[Ee]very communication op takes `axis:`[^.]*",
                                 path.read_text()):
            assert "team_ops()" in claim.group(0) or "only" in claim.group(0), (
                path, claim.group(0))


# the packages whose diagnostics `dcpc check` / `dcpc compile` print: the parser, the
# checkers, the ops' rules, the lowering, and the top-level modules (files, pipeline);
# dcpc/harness, dcpc/engines and dcpc/runtime report for `dcpc run` and the engines
CHECKER_SOURCES = ("lang", "check", "ops", "codegen", "*.py")


def _callee(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def emitted_codes() -> dict[str, str]:
    """Every diagnostic code the checker/parser sources can emit -> where, read from the
    code: the string (or module constant) in the `code` position of every call to a
    carrier. Carriers: functions with a parameter `code` (Diagnostic, ctx.error, fail),
    and classes with a field `code`, or whose field is passed to Diagnostic as its code
    (the hb Finding's `kind`). A code argument the scan cannot read fails the test."""
    files = [p for pattern in CHECKER_SOURCES
             for p in sorted((ROOT / "dcpc").glob(pattern if pattern.endswith(".py")
                                                   else f"{pattern}/**/*.py"))]
    trees = {p: ast.parse(p.read_text()) for p in files}
    constants: dict[str, str] = {}
    carriers: dict[str, set[int]] = {}
    for tree in trees.values():
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                constants[node.targets[0].id] = node.value.value
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in node.args.posonlyargs + node.args.args]
                params = params[1:] if params[:1] in (["self"], ["cls"]) else params
                if "code" in params:
                    carriers.setdefault(node.name, set()).add(params.index("code"))
            elif isinstance(node, ast.ClassDef):
                fields = [s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                passed = [c.args[1].attr for c in ast.walk(node) if isinstance(c, ast.Call)
                          and _callee(c.func) == "Diagnostic" and len(c.args) > 1
                          and isinstance(c.args[1], ast.Attribute)
                          and _callee(c.args[1].value) == "self"]
                for name in {"code", *passed} & set(fields):
                    carriers.setdefault(node.name, set()).add(fields.index(name))
    ambiguous = {k: v for k, v in carriers.items() if len(v) > 1}
    assert not ambiguous, f"carriers of one name with the code in two places: {ambiguous}"
    codes: dict[str, str] = {}
    unread = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or _callee(node.func) not in carriers:
                continue
            (index,) = carriers[_callee(node.func)]
            arg = (node.args[index] if len(node.args) > index
                   else next((k.value for k in node.keywords if k.arg == "code"), None))
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for value in [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    codes.setdefault(value.value, where)
                elif isinstance(value, ast.Name) and value.id in constants:
                    codes.setdefault(constants[value.id], where)
                elif not (  # passed on: a carrier's own parameter or a carrier's field
                        (isinstance(value, ast.Name) and value.id == "code")
                        or (isinstance(value, ast.Attribute) and value.attr in ("code", "kind"))):
                    unread.append(f"{where}: {ast.unparse(value) if value else value}")
    assert not unread, f"code arguments the scan cannot read (teach it): {unread}"
    return codes


def _error_class_table() -> dict[str, str]:
    text = (ROOT / "docs/language.md").read_text()
    start = text.index("### Error classes")
    section = text[start:text.index("\n## ", start)]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = line.split("|")
            for code in re.findall(r"`([a-z][a-z0-9-]*)`", cells[1]):
                rows[code] = cells[2].strip()
    return rows


def test_every_code_the_checker_can_emit_is_in_the_error_class_table():
    """Issue 33: `axis-unsupported`, the loops' codes and others were emitted but not
    in docs/language.md's table. The codes are read from the source, not listed here."""
    codes = emitted_codes()
    for code in ("axis-unsupported", "aliased-buffer", "race", "deadlock", "io",
                 "unmatched-signal", "loop-world", "bad-repeat"):  # the scan finds them
        assert code in codes, code
    table = _error_class_table()
    missing = {c: w for c, w in codes.items() if c not in table}
    assert not missing, f"emitted but not in the error-class table: {missing}"
    assert all(len(meaning) > 10 for meaning in table.values()), table


def _op_key_tables() -> dict[str, set[str]]:
    """op -> the keys its rows of the `| op | keys | ... |` tables under "## Ops" name:
    the backticked names of the keys cell outside parentheses (`to: all \\| next` is
    key `to`; '(symmetric, `src`'s shape)' says something about a key, and is skipped)."""
    text = (ROOT / "docs/language.md").read_text()
    start = text.index("\n## Ops")
    section = text[start:text.index("\n## ", start + 1)]
    keys: dict[str, set[str]] = {}
    in_table = False
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if not cells:
            in_table = False
            continue
        if cells[:2] == ["op", "keys"]:
            in_table = True
            continue
        if not in_table or set(cells[0]) <= set("- "):
            continue
        (op,) = re.fullmatch(r"`([a-z_]+)`", cells[0]).groups()
        outside, depth = [], 0
        for char in cells[1]:
            depth += char == "("
            if depth == 0:
                outside.append(char)
            depth -= char == ")" and depth > 0
        names = re.findall(r"`([a-z_]+)[^`]*`", "".join(outside))
        keys.setdefault(op, set()).update(names)
    return keys


def test_the_op_tables_list_exactly_the_keys_of_each_op_s_model():
    """Issue 33 item 5: the keys an op takes are its pydantic model's fields (by their
    YAML names: `from`, not `from_`), less the ones every op has (`op`, the
    discriminator, `doc`, the source marks); `axis` only where the op takes a team."""
    from dcpc.lang.nodes import OpBase
    from dcpc.ops.registry import OPS

    common = {f.alias or name for name, f in OpBase.model_fields.items()}
    documented = _op_key_tables()
    assert set(documented) == set(OPS), set(documented) ^ set(OPS)
    for name, op in OPS.items():
        fields = {f.alias or key for key, f in op.model.model_fields.items()
                  if not f.exclude}  # the unroller's own (a reserved '__' key)
        want = (fields - common - {"op"}) | ({"axis"} if op.teams else set())
        assert documented[name] == want, (name, sorted(documented[name]), sorted(want))
    text = (ROOT / "docs/language.md").read_text()
    every = text[text.index("Every step may also carry"):].split("\n\n", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", every)) == common - {"axis"} - {
        f.alias for f in OpBase.model_fields.values() if f.exclude}


def test_the_generated_op_table_is_the_ops_rules_in_words() -> None:
    """docs/language.md's generated op table is made from each op's semantics rule over
    the conformance files (tests/support/op_table.py), not copied by hand: an op whose
    rule changes changes the table, and this test names the difference. It lives with
    the hand-written op rows, so a new op's docs are one file (docs/internals.md holds
    the layers and the recipe, no op's row)."""
    from support import op_table

    from dcpc.ops.registry import OPS

    want = op_table.text()
    assert op_table.shown(op_table.DOC.read_text()) == want, (
        "docs/language.md's op table differs from the ops' rules; rewrite it with: "
        "PYTHONPATH=. python tests/support/op_table.py --write\n" + want)
    internals = (ROOT / "docs" / "internals.md").read_text()
    assert op_table.START.strip() not in internals
    assert not [op for op in OPS if f"| {op} |" in internals or f"| `{op}` |" in internals]
