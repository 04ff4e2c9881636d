"""Nothing in a schedule is executed: code in names, docs and YAML tags stays inert.

Every payload that would run tries to create a sentinel file; the tests assert the
sentinel never appears. Names that carry code are rejected by the identifier rule;
a doc that carries code passes through parse only as a string, and (once the code
generator exists) comes out of emit as an inert docstring.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dcpc.check import check
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
BASE = (ROOT / "schedules" / "kimi_k3_dcp.yaml").read_text()
WORLDS = list(range(2, 9))


def _touch(sentinel: Path) -> str:
    return f"open({str(sentinel)!r}, 'w').close()"


def _tag_payloads(sentinel: Path) -> list[str]:
    touch = _touch(sentinel)
    shell = f"touch {sentinel}"
    return [
        f"!!python/object/apply:os.system [{shell!r}]",
        f"!!python/object/apply:builtins.exec [{touch!r}]",
        f"!!python/object/new:subprocess.Popen [[touch, {str(sentinel)!r}]]",
        "!!python/name:os.system",
        "!!python/module:os",
        f"!!python/object/apply:builtins.eval [{touch!r}]",
        f"!python/object/apply:os.system [{shell!r}]",
    ]


def _places(payload: str) -> list[str]:
    """The payload as the doc, the schedule name, a size, a buffer flag and a step key."""
    return [
        BASE.replace("doc: >\n", f"doc: {payload}\nx_doc: >\n", 1).replace("x_doc: >", "#", 1),
        BASE.replace("schedule: kimi_k3_dcp", f"schedule: {payload}", 1),
        BASE.replace("D: 576", f"D: {payload}", 1),
        BASE.replace("symmetric: true}", f"symmetric: {payload}}}", 1),
        BASE.replace("dim: 1}", f"dim: 1, doc: {payload}}}", 1),
    ]


@pytest.mark.parametrize("index", range(7))
def test_python_tags_never_run(tmp_path: Path, index: int) -> None:
    sentinel = tmp_path / "SENTINEL"
    payload = _tag_payloads(sentinel)[index]
    for text in _places(payload):
        try:
            schedule = parse_text(text, "evil.yaml")
        except DiagnosticError as exc:
            assert all(d.mark.line >= 1 for d in exc.diagnostics)
        else:
            # the tag was ignored: whatever it decorated is plain data, and bad data
            for value in (schedule.doc, schedule.schedule):
                assert value is None or isinstance(value, str)
            check(schedule, WORLDS)
        assert not sentinel.exists(), f"a YAML tag ran code: {payload}"


CODE_NAMES = [
    "x'); __import__('os').system('touch SENTINEL'); ('",
    "__import__('os').system('id')",
    "a\nimport os",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for x in () %}{% endfor %}",
    "q\"\"\"; import os; \"\"\"",
    "exec",  # a valid identifier, but reserved for nothing: allowed as a step name
]


@pytest.mark.parametrize("name", CODE_NAMES[:-1])
@pytest.mark.parametrize("where", ["schedule", "step", "buffer", "size", "channel"])
def test_names_with_code_are_rejected(name: str, where: str) -> None:
    quoted = '"' + name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if where == "schedule":
        text = BASE.replace("schedule: kimi_k3_dcp", f"schedule: {quoted}", 1)
    elif where == "step":
        text = BASE.replace("  - merge:", f"  - {quoted}:", 1)
    elif where == "buffer":
        text = BASE.replace("  out:", f"  {quoted}:", 1).replace("dst: out,", f"dst: {quoted},")
    elif where == "size":
        text = BASE.replace("  D: 576", f"  {quoted}: 576", 1)
    else:
        text = BASE + f"  - ping: {{op: signal, channel: {quoted}}}\n" \
            f"  - pong: {{op: wait, channel: {quoted}}}\n"
    try:  # names used as mapping keys that start with '__' are refused by the parser
        found = check(parse_text(text, "evil.yaml"), WORLDS)
    except DiagnosticError as exc:
        found = exc.diagnostics
    bad = [d for d in found if d.code in ("bad-identifier", "reserved-key")]
    assert bad, [d.render() for d in found]
    assert all(d.mark.line >= 1 for d in bad)


def test_plain_identifier_that_names_a_builtin_is_only_a_name() -> None:
    text = BASE.replace("  - merge:", f"  - {CODE_NAMES[-1]}:", 1)
    assert check(parse_text(text), WORLDS) == []


EVIL_DOC = (
    '"""\n\'\'\'\nimport os; os.system("touch SENTINEL")\n'
    "{{ 6*7 }} {% raw %} __import__('os').system('id') \\\n"
)


def _with_doc(doc: str, base: str = BASE) -> str:
    escaped = doc.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    start = base.index("doc: >")
    end = base.index("slots:")
    return base[:start] + f'doc: "{escaped}"\n' + base[end:]


def test_doc_with_code_is_only_a_string() -> None:
    schedule = parse_text(_with_doc(EVIL_DOC))
    assert schedule.doc == EVIL_DOC
    assert check(schedule, WORLDS) == []


def test_emitted_module_keeps_code_inert(tmp_path: Path) -> None:
    emit = pytest.importorskip("dcpc.codegen.emit")
    lower = pytest.importorskip("dcpc.codegen.lower")
    sentinel = tmp_path / "SENTINEL"
    doc = EVIL_DOC.replace("SENTINEL", str(sentinel)) + _touch(sentinel) + "\n"
    # kv_gather: the smallest shipped schedule (this test is about the doc, not the ops)
    base = (ROOT / "schedules" / "kv_gather.yaml").read_text()
    schedule = parse_text(_with_doc(doc, base), "evil.yaml")
    assert check(schedule, WORLDS) == []
    text = emit.emit(lower.lower(schedule, WORLDS))
    tree = ast.parse(text)  # the emitted text is valid Python
    docstring = ast.get_docstring(tree) or ""
    assert "6*7" in docstring and "{{" in docstring  # not rendered by Jinja
    assert "42" not in docstring
    for node in ast.walk(tree):  # the payload is in no call
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            assert node.func.attr != "system"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in ("__import__", "exec", "eval")
    module = tmp_path / f"{schedule.schedule}.py"
    module.write_text(text)
    done = subprocess.run(
        [sys.executable, "-c", f"import {schedule.schedule} as m; print(m.__doc__ is not None)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
    assert not sentinel.exists()
