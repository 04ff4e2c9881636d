"""Fuzzing parse + structural check: bad input gives diagnostics, never a traceback.

The shipped schedules are mutated (keys deleted, values replaced by wrong types and
random scalars, list items swapped, the text truncated or sprinkled with random
unicode). Every outcome must be a Schedule whose check() returns diagnostics with
real marks, or a DiagnosticError with the same property; any other exception fails.

The example count comes from the "dcpc-fuzz" hypothesis profile below (3 tests x
800 examples); set DCPC_FUZZ_EXAMPLES to run more (or fewer) per test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpc.check import check
from dcpc.diagnostics import Diagnostic, DiagnosticError
from dcpc.lang.model import Schedule
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [p.read_text() for p in sorted((ROOT / "schedules").glob("*.yaml"))]
DATA = [yaml.safe_load(t) for t in TEXTS]
WORLDS = [2, 3, 4, 5, 8]

settings.register_profile(
    "dcpc-fuzz",
    max_examples=int(os.environ.get("DCPC_FUZZ_EXAMPLES", "800")),
    deadline=None,
    database=None,  # no .hypothesis/ files in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile("dcpc-fuzz")


def _assert_diagnostics(found: list[Diagnostic], file: str) -> None:
    for d in found:
        assert d.message.strip(), d
        assert d.code and d.severity in ("error", "warning"), d
        assert d.mark.file == file, d
        # a position in the file, or line 0 for what concerns the whole file
        assert d.mark.line >= 1 and d.mark.col >= 1 or (d.mark.line, d.mark.col) == (0, 0), d


def run(text: str) -> list[Diagnostic]:
    """Parse and check; return the diagnostics (asserting they are well formed)."""
    file = "fuzz.yaml"
    try:
        schedule = parse_text(text, file)
    except DiagnosticError as exc:
        assert exc.diagnostics, "a DiagnosticError without diagnostics"
        _assert_diagnostics(exc.diagnostics, file)
        return exc.diagnostics
    assert isinstance(schedule, Schedule)
    found = check(schedule, WORLDS)
    _assert_diagnostics(found, file)
    return found


# ---- data-level mutations -----------------------------------------------------------

SYMBOLS = st.sampled_from([
    "T", "H", "W", "D", "Dv", "B", "q_full", "o_part", "lse_part", "out", "all", "next",
    "e", "2", "H/W", "W*T", "T-1", "(T", "H/0", "0", "-1", "f32", "i32", "x y", "", "__x__",
])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 80), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), SYMBOLS, st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(SYMBOLS, inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += _paths(value, (*prefix, i))
    return out


def _parent(data: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        data = data[part]
    return data


@st.composite
def mutated_data(draw: st.DrawFn) -> str:
    import copy

    data = copy.deepcopy(draw(st.sampled_from(DATA)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(data) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _parent(data, path)
        action = draw(st.sampled_from(["delete", "replace", "swap", "rename", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "replace":
            parent[path[-1]] = draw(VALUES)
        elif action == "swap" and isinstance(parent, list) and len(parent) > 1:
            j = draw(st.integers(0, len(parent) - 1))
            parent[path[-1]], parent[j] = parent[j], parent[path[-1]]
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(SYMBOLS)] = parent.pop(path[-1])
        elif action == "add" and isinstance(parent, dict):
            parent[draw(SYMBOLS)] = draw(VALUES)
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False, default_flow_style=None)


@st.composite
def retyped_leaves(draw: st.DrawFn) -> str:
    """Leaves replaced by values of the same type: the result usually parses, so the
    structural checks (names, shapes, dtypes, dims, bases) get most of the work."""
    import copy

    data = copy.deepcopy(draw(st.sampled_from(DATA)))
    names = sorted(set(data["buffers"]) | set(data["sizes"]) | {"W", "e", "2", "all"})
    for _ in range(draw(st.integers(1, 4))):
        leaves = [p for p in _paths(data) if p and not isinstance(_get(data, p), (dict, list))]
        path = draw(st.sampled_from(leaves))
        old = _get(data, path)
        if isinstance(old, bool):
            new: Any = draw(st.booleans())
        elif isinstance(old, int):
            new = draw(st.integers(-2, 80))
        else:
            new = draw(st.one_of(st.sampled_from(names), SYMBOLS,
                                 st.sampled_from(["bf16", "f16", "i64", "fp8e4m3"])))
        _parent(data, path)[path[-1]] = new
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False, default_flow_style=None)


def _get(data: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        data = data[part]
    return data


# ---- text-level mutations -----------------------------------------------------------

@st.composite
def mutated_text(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 3))):
        if not text:
            break
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["truncate", "insert", "delete", "line", "swap"]))
        if action == "truncate":
            text = text[:at]
        elif action == "insert":
            text = text[:at] + draw(st.text(min_size=1, max_size=8)) + text[at:]
        elif action == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 20)):]
        else:
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            j = draw(st.integers(0, len(lines) - 1))
            if action == "line":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
    return text


@FUZZ
@given(mutated_data())
def test_mutated_schedules_give_diagnostics(text: str) -> None:
    run(text)


@FUZZ
@given(retyped_leaves())
def test_retyped_schedules_give_diagnostics(text: str) -> None:
    run(text)


@FUZZ
@given(mutated_text())
def test_mutated_text_gives_diagnostics(text: str) -> None:
    run(text)


def test_fuzz_budget_is_at_least_2000_examples() -> None:
    assert 3 * FUZZ.max_examples >= 2000 or "DCPC_FUZZ_EXAMPLES" in os.environ


def test_unmutated_schedules_are_clean() -> None:
    for text in TEXTS:
        assert run(text) == []
