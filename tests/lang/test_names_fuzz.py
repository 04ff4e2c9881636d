"""Issue 13 items 3 and 6: names cannot collide with the generated code, and every
module `check` accepts compiles, imports and passes ruff.

The names tried are not a list kept here: they are every name the emitted modules of
the shipped schedules use (each local, argument, attribute, function, class and import
alias, read with ``ast``), the same with their leading '_' removed, the step part of
``_<step>_kernel`` / ``_<step>_push``, and long and odd names. Each is put in valid
schedules as a schedule, buffer and step name, through the real command line:
exit 0, 1 or 2, never a traceback, every error located; check-accepted implies
compile-accepted; every module compiled imports (one subprocess) and `ruff check`
passes on all of them (one run).
"""

from __future__ import annotations

import ast
import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.ruff import RUFF, RUFF_CONFIG

from dcpc.check.names import MAX_NAME
from dcpc.cli import main
from dcpc.codegen.emit import emit
from dcpc.codegen.lower import base_class_names, lower, method_names
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "schedules").glob("*.yaml"))
DATA = {p.stem: yaml.safe_load(p.read_text()) for p in SHIPPED}
LOCATED = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (error|warning): ")
NOT_BUFFERS = {"op", "channel", "to", "from", "lse_base", "doc", "dim", "interleave"}
OK = re.compile(r"^\S.*(: ok \(| -> .*\.py \()")  # `check` and `compile` say what they did
WORLD = "2"


def _emitted_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every name of the shipped schedules' emitted modules, and per method its free
    names (what a buffer, a parameter there, could shadow)."""
    names: set[str] = set()
    free: dict[str, set[str]] = {}
    for path in SHIPPED:
        tree = ast.parse(emit(lower(parse_file(path), [2])))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        for method in cls.body:
            if isinstance(method, ast.FunctionDef):
                params = {a.arg for a in method.args.args + method.args.kwonlyargs}
                body = ast.Module(body=method.body, type_ignores=[])
                used = {n.id for n in ast.walk(body) if isinstance(n, ast.Name)}
                free[f"{path.stem}.{method.name}"] = used - params
    return names, free


EMITTED, FREE = _emitted_names()
DERIVED = {n.lstrip("_") for n in EMITTED} | {
    m[1] for n in EMITTED if (m := re.fullmatch(r"_(\w+)_(kernel|push)", n))
}
ODD = {"_1", "_", "a", "i", "i_", "o", "l", "none", "true", "false", "null", "a__b", "x1",
       "n" * MAX_NAME, "n" * (MAX_NAME + 1), "s" * 253, "Kimi", "kimi-k3", "é", "1a", "a b",
       "match"}
# and what the generated class inherits (read from the runtime's source, as lower does)
CANDIDATES = sorted(n for n in EMITTED | DERIVED | ODD | base_class_names() if n)


def test_the_generated_methods_reach_only_their_own_names_and_underscored_ones() -> None:
    """The construction: a method body's free names are its parameters, `self`, `slot`,
    `sizes`, `call_id` (derived from the template: lower.method_names) and names starting
    with '_' (module globals, its locals), so no buffer can shadow one."""
    assert method_names() == {"self", "slot", "sizes", "call_id"}
    for method, used in FREE.items():
        assert {n for n in used if not n.startswith("_")} <= method_names(), method
    # every module-level helper is _dcpc_*: none ends like a step's kernel or push
    helpers = {n for n in EMITTED if n.startswith("_dcpc_")}
    assert helpers and not any(re.search(r"_(kernel|push)\Z", n) for n in helpers)
    # what a step cannot be is read from the runtime's source, not listed
    assert {"close", "buffer", "check_errors", "rank", "world", "device"} <= base_class_names()
    assert not any(n.startswith("_") for n in base_class_names())


# ---- building schedules --------------------------------------------------------

def _rename(data: dict[str, Any], schedule: str | None = None,
            buffers: dict[str, str] | None = None,
            steps: dict[str, str] | None = None) -> dict[str, Any]:
    data = copy.deepcopy(data)
    buffers, steps = buffers or {}, steps or {}
    if schedule is not None:
        data["schedule"] = schedule
    data["buffers"] = {buffers.get(k, k): v for k, v in data["buffers"].items()}

    def sub(value: Any, key: str | None = None) -> Any:
        if key in NOT_BUFFERS:
            return value
        if isinstance(value, str):
            return buffers.get(value, value)
        if isinstance(value, list):
            return [sub(v) for v in value]
        if isinstance(value, dict):
            return {k: sub(v, k) for k, v in value.items()}
        return value

    data["steps"] = [
        {steps.get(name, name): sub(op) for name, op in item.items()} for item in data["steps"]
    ]
    return data


def _names(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    return list(data["buffers"]), [next(iter(item)) for item in data["steps"]]


def _long(name: str, i: int) -> str:
    """A distinct name of exactly MAX_NAME characters."""
    return (f"{name}_{i}_" + "x" * MAX_NAME)[:MAX_NAME]


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _assert_clean(result: Any) -> None:
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, \
        result.output
    for line in result.output.splitlines():
        # a located diagnostic, its indented hint, or the one line a success prints
        assert LOCATED.match(line) or line.startswith("  ") or OK.match(line), line


class Corpus:
    """Schedule files written to a folder, checked and compiled in batches."""

    def __init__(self, root: Path):
        self.root = root
        self.count = 0
        self.modules: list[Path] = []
        self.accepted = 0

    def run(self, cases: list[dict[str, Any]]) -> None:
        folder = self.root / f"batch{self.count}"
        folder.mkdir()
        files = []
        for data in cases:
            self.count += 1
            path = folder / f"case{self.count}.yaml"
            path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
            files.append(path)
        for path in files:
            checked = _invoke("check", "--world", WORLD, str(path))
            _assert_clean(checked)
            out = self.root / "out" / path.stem
            compiled = _invoke("compile", "--world", WORLD, str(path), "-o", str(out))
            _assert_clean(compiled)
            if checked.exit_code == 0:  # check-accepted implies compile-accepted
                assert compiled.exit_code == 0, (path.read_text(), compiled.output)
                (module,) = out.glob("*.py")
                self.modules.append(module)
                self.accepted += 1
            else:  # and what check refuses, compile refuses with the same diagnostics
                assert compiled.exit_code == checked.exit_code, compiled.output
                assert errors(compiled.output) == errors(checked.output)


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if ": error: " in line]


# ---- the cases -------------------------------------------------------------------

def _sweep() -> list[dict[str, Any]]:
    """Every candidate as a schedule name, as a buffer name (an engine buffer: a method's
    parameter) and as a step name (a method), one at a time."""
    base = DATA["kv_gather"]
    cases = []
    for i, name in enumerate(CANDIDATES):
        cases.append(_rename(base, schedule=name))
        cases.append(_rename(base, schedule=f"sweep_b{i}", buffers={"kv_local": name}))
        cases.append(_rename(base, schedule=f"sweep_s{i}", steps={"kv_gather": name}))
    return cases


def _longest() -> list[dict[str, Any]]:
    """Every shipped schedule with every name at the maximum length."""
    cases = []
    for stem, data in DATA.items():
        buffers, steps = _names(data)
        cases.append(_rename(
            data, schedule=_long(stem, 0),
            buffers={b: _long(b, i) for i, b in enumerate(buffers)},
            steps={s: _long(s, i) for i, s in enumerate(steps)},
        ))
    return cases


NAME = st.one_of(
    st.sampled_from(CANDIDATES),
    st.from_regex(r"[a-z][a-z0-9_]{0,60}", fullmatch=True),
    st.text(alphabet="ab_1Z-é", min_size=1, max_size=8),
)


@st.composite
def renamed(draw: st.DrawFn) -> dict[str, Any]:
    stem = draw(st.sampled_from(sorted(DATA)))
    data = DATA[stem]
    buffers, steps = _names(data)
    return _rename(
        data,
        schedule=draw(NAME),
        buffers={b: draw(NAME) for b in buffers if draw(st.booleans())},
        steps={s: draw(NAME) for s in steps if draw(st.booleans())},
    )


def test_names_never_collide_and_accepted_modules_import_and_pass_ruff(tmp_path: Path) -> None:
    corpus = Corpus(tmp_path)
    corpus.run(_longest())
    assert corpus.accepted == len(DATA)  # the longest names allowed compile everywhere
    longest = [str(p) for p in corpus.modules]
    corpus.run(_sweep())
    drawn: list[dict[str, Any]] = []

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(renamed())
    def draw(data: dict[str, Any]) -> None:
        drawn.append(data)

    draw()
    corpus.run(drawn)
    assert corpus.accepted > len(DATA) + len(CANDIDATES) // 2, corpus.accepted

    # a name refused by check says so at its place, e.g. a leading '_' or 253 characters
    for bad, says in (("_1", "names starting with '_'"), ("s" * 253, "253 characters")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(_rename(DATA["kv_gather"], schedule=bad), sort_keys=False))
        result = _invoke("check", "--world", WORLD, str(path))
        assert result.exit_code == 1 and f"{path}:1:11: error: schedule name " in result.output
        assert says in result.output and "[bad-identifier]" in result.output

    files = [str(p) for p in corpus.modules]
    ruff = subprocess.run(RUFF + ["check", "--no-cache", *RUFF_CONFIG, *files],
                          capture_output=True, text=True)
    assert ruff.returncode == 0, ruff.stdout[-5000:] + ruff.stderr
    fmt = subprocess.run(RUFF + ["format", "--no-cache", "--check", *RUFF_CONFIG, *longest],
                         capture_output=True, text=True)  # even formatted as ruff would
    assert fmt.returncode == 0, fmt.stdout[-5000:] + fmt.stderr
    script = IMPORT_ALL + f"check({files!r})\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    assert f"imported {len(files)}" in done.stdout


# Each module imported as an engine does: its folder on sys.path, `import <schedule>`.
IMPORT_ALL = """
import importlib, os, sys
os.environ["TRITON_INTERPRET"] = "1"
from dcpc.runtime import ScheduleModule

def check(files):
    for path in files:
        folder, name = os.path.split(path[:-3])
        sys.path.insert(0, folder)
        module = importlib.import_module(name)
        sys.path.remove(folder)
        del sys.modules[name]
        (cls,) = [c for c in vars(module).values()
                  if isinstance(c, type) and issubclass(c, ScheduleModule) and c.SCHEDULE]
        assert cls.SCHEDULE == name, (cls.SCHEDULE, name)
        for method in cls.METHODS:
            assert callable(getattr(cls, method)), (name, method)
    print("imported", len(files))
"""
