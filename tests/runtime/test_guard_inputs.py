"""Names and limits that passed check and failed later (issue 22 item 10): schedule
names that shadow importable modules, a huge interleave, parentheses past the depth
limit, YAML keys that are numbers or booleans, and the hint of yaml-too-large."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcpc.check import check
from dcpc.diagnostics import Diagnostic, DiagnosticError
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
KV = (ROOT / "schedules" / "kv_gather.yaml").read_text()


def errors(text: str) -> list[Diagnostic]:
    try:
        found = check(parse_text(text, "t.yaml"), list(range(2, 9)))
    except DiagnosticError as exc:
        found = exc.diagnostics
    return [d for d in found if d.severity == "error"]


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


@pytest.mark.parametrize("name", [
    "numpy", "typing_extensions", "yaml", "sitecustomize", "usercustomize", "torch",
    "triton", "jinja2", "pydantic", "json", "vllm",
])
def test_schedule_names_that_shadow_a_module_are_refused(name: str) -> None:
    out = errors(edit(KV, "schedule: kv_gather", f"schedule: {name}"))
    assert [d.code for d in out] == ["reserved-name"]
    assert (out[0].mark.line, out[0].mark.col) == (1, 11)
    assert f"shadows the importable module '{name}'" in out[0].message
    assert out[0].hint == f"rename it, e.g. to '{name}_dcp'"


def test_compile_refuses_a_shadowing_name_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "numpy.yaml"
    path.write_text(edit(KV, "schedule: kv_gather", "schedule: numpy"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "dcpc", "compile", str(path), "-o",
                           str(tmp_path / "out"), "--world", "2..4"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "numpy.yaml:1:11: error:" in done.stdout + done.stderr
    assert not (tmp_path / "out" / "numpy.py").exists()


@pytest.mark.parametrize("value", [2147483648, 3, 65536])
def test_an_interleave_that_does_not_divide_the_rows_is_refused(value: int) -> None:
    out = errors(edit(KV, "interleave: 1}", f"interleave: {value}}}"))
    assert [d.code for d in out] == ["bad-interleave"]
    assert (out[0].mark.line, out[0].mark.col) == (18, 90)
    assert f"interleave {value} of step 'kv_gather' must divide the rows" in out[0].message
    assert "(N=1)" in out[0].message


def test_an_interleave_that_divides_every_binding_passes() -> None:
    text = edit(KV, "N: {max: 65536}", "N: {multiple_of: 4, max: 65536}")
    assert errors(edit(text, "interleave: 1}", "interleave: 4}")) == []
    assert errors(KV) == []


def test_parentheses_deeper_than_the_limit_are_refused() -> None:
    deep = "(" * 65 + "N" + ")" * 65
    out = errors(edit(KV, "shape: [N, K]", f'shape: ["{deep}", K]'))
    assert [d.code for d in out] == ["shape-syntax"]
    assert "nest deeper than 64" in out[0].message
    assert (out[0].mark.line, out[0].mark.col) == (15, 22 + 64)  # the 65th "("
    ok = "(" * 64 + "N" + ")" * 64
    assert errors(edit(KV, "shape: [N, K]", f'shape: ["{ok}", K]')) == []


@pytest.mark.parametrize("key,kind", [
    (".inf", "a number"), (".nan", "a number"), ("-.inf", "a number"), ("1.5", "a number"),
    ("yes", "true or false"), ("true", "true or false"), ("null", "empty"),
    ("2024-01-01", "a date or time"),
])
def test_size_keys_that_yaml_reads_as_values_are_refused(key: str, kind: str) -> None:
    out = errors(edit(KV, "  K: 576", f"  K: 576\n  {key}: 4"))
    assert [d.code for d in out] == ["yaml-key"]
    assert (out[0].mark.line, out[0].mark.col) == (14, 3)
    assert out[0].message == f"the key {key!r} reads as {kind} in YAML, not as a name"


def test_integer_and_quoted_keys_keep_their_meaning() -> None:
    # an integer key stays its text (then fails as a size name), a quoted one is text
    assert [d.code for d in errors(edit(KV, "  K: 576", "  K: 576\n  '.inf': 4"))] == [
        "bad-identifier"]
    assert [d.code for d in errors(edit(KV, "  K: 576", "  K: 576\n  12: 4"))] == [
        "bad-identifier"]


def test_yaml_too_large_names_aliases_only_when_there_are_some() -> None:
    plain = "schedule: t\ndoc: [" + ", ".join(["1"] * 100_001) + "]\n"
    out = errors(plain)
    assert [d.code for d in out] == ["yaml-too-large"]
    assert "alias" not in (out[0].hint or "") + out[0].message
    from dcpc.lang.yamlsrc import NODE_BUDGET

    assert f"more than {NODE_BUDGET} YAML nodes" in out[0].message
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for name, prev in zip("bcdefg", "abcdef", strict=True):
        bomb += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]\n"
    out = errors(bomb)
    assert [d.code for d in out] == ["yaml-too-large"]
    assert "aliases" in (out[0].hint or "")


TWO = """\
schedule: two_payloads
slots: 1
sizes: {N: {multiple_of: 4, max: 64}, M: {max: 64}, K: 8}
buffers:
  kv_local: {shape: [N, K], dtype: bf16}
  kv_scale: {shape: [M, 1], dtype: f32}
  kv_full: {shape: [W*N, K], dtype: bf16, symmetric: true}
  scale_full: {shape: [W*M, 1], dtype: f32, symmetric: true}
steps:
  - gather: {op: all_gather, src: [kv_local, kv_scale], dst: [kv_full, scale_full], interleave: 4}
  - attention: {op: external, reads: [kv_full, scale_full]}
  - release: {op: barrier}
"""


def test_an_interleaved_gather_of_several_payloads_checks_each_one() -> None:
    """``src``/``dst`` lists (one exchange, several payloads): each payload's rows are
    checked; before, ``src: [T]`` ended `dcpc check` in an internal TypeError (found by
    tests/lang/test_fuzz.py's mutations)."""
    out = errors(TWO)
    assert [d.code for d in out] == ["bad-interleave"], out  # M is not a multiple of 4
    assert "rows of src 'kv_scale' (M)" in out[0].message, out[0].message
    assert errors(edit(TWO, "M: {max: 64}", "M: {multiple_of: 4, max: 64}")) == []
    unknown = errors(edit(KV, "src: kv_local", "src: [T]"))
    assert [d.code for d in unknown] == ["unknown-buffer"], unknown
