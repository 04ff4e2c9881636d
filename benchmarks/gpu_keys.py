"""What a GPU conformance case runs, as a key of four parts: "module", the sha256 of
the module `dcpc run` compiles for the file at that world; "runtime", "harness" and
"reference", the sha256 of the code the run executes besides the module (code_files:
each part the import closure within dcpc of its entry points). Two runs with equal keys
ran the same code (benchmarks/gpu_pending.py settles a case by it; gpu_conformance.py
records it in every record).

    python3 benchmarks/gpu_keys.py TREE < cases.json   # [[file, world], ...] -> keys JSON

computes the keys with TREE's own compiler (TREE first on sys.path: a checkout, or a
commit's `git archive` unpacked): {"runtime": sha, "harness": sha, "reference": sha,
"modules": {"file@world": sha | null}}
(null: that tree cannot compile the file at that world). Only the standard library is
imported at the top: this file runs against other trees' dcpc.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import tempfile
from pathlib import Path

# What a `python3 -m dcpc run --device cuda --backend local` case executes besides its
# module, by where it starts (a folder: its Python files; a path a tree lacks: nothing):
# the runtime the module imports (RUNTIME_ENTRY), the harness that drives the ranks and
# compares their outputs (HARNESS_ENTRY), and what else the run executes (REFERENCE_ENTRY):
# the CLI (`python -m dcpc`), the op modules dcpc.ops imports by name (the inputs' rules:
# input_rules, inputs, io, moves; the float64 reference's semantics) and dcpc.lang. Each
# part of the key is the import closure within dcpc of its entry (code_files: every
# `import` of a file, at the top or in a function, is followed), less the parts before it.
RUNTIME_ENTRY = ("dcpc/runtime",)
HARNESS_ENTRY = ("dcpc/harness",)
REFERENCE_ENTRY = ("dcpc/__main__.py", "dcpc/ops", "dcpc/lang")
CODE_PARTS = ("runtime", "harness", "reference")
# Never executed on a GPU: imported or called only where the device is the CPU (not read,
# not followed by the closure).
# dcpc.harness.interpret: worker.run_rank imports it under `device == "cpu"`;
# dcpc.runtime.local's interpreter shim: worker.run_rank installs it under
# `device == "cpu"`, LocalGroup only when its device is not cuda (tests/run/
# test_gpu_pending.py checks every use of these names stays behind such a test, and that
# a cuda run never imports dcpc.harness.interpret).
CPU_ONLY_FILES = ("dcpc/harness/interpret.py",)
CPU_ONLY_DEFS = {"dcpc/runtime/local.py": ("_install_interpreter_threads",
                                           "_lazy_tuple_types", "_np_dtype_memo",
                                           "_no_discarded_overflow_checks",
                                           "_shared_block_types")}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def without_defs(text: str, names: tuple[str, ...]) -> str:
    """``text`` without the top-level functions ``names`` (decorators and the blank lines
    after each included)."""
    lines = text.splitlines(keepends=True)
    drop: set[int] = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in names:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            end = node.end_lineno or node.lineno
            while end < len(lines) and not lines[end].strip():
                end += 1  # the blank lines after it too: the functions around it may move
            drop.update(range(first - 1, end))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def _text(tree: Path, rel: str) -> bytes:
    """A file's bytes as the key reads them: less its CPU-only functions."""
    data = (tree / rel).read_bytes()
    if rel in CPU_ONLY_DEFS:
        data = without_defs(data.decode("utf-8"), CPU_ONLY_DEFS[rel]).encode()
    return data


def _module_file(tree: Path, name: str) -> str | None:
    """The file of module ``name`` in ``tree`` (None: not a module there)."""
    base = tree.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(tree).as_posix()
    return None


def imported(tree: Path, rel: str) -> set[str]:
    """The dcpc modules file ``rel`` imports (every import statement in it; ``from a
    import b``: a and, where it is a module, a.b; relative imports resolved), with the
    packages above each (importing dcpc.x.y runs dcpc/__init__ and dcpc/x/__init__)."""
    parts = rel[:-3].split("/")
    package = parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(_text(tree, rel))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    names |= {".".join(parts[:i]) for i in range(1, len(parts))}  # its own packages
    out = set()
    for name in names:
        dotted = name.split(".")
        if dotted[0] == "dcpc":
            out |= {".".join(dotted[:i]) for i in range(1, len(dotted) + 1)}
    return out


def _python_files(tree: Path, entries: tuple[str, ...]) -> list[str]:
    out = []
    for entry in entries:
        path = tree / entry
        if path.is_dir():
            out += [p.relative_to(tree).as_posix() for p in sorted(path.rglob("*.py"))]
        elif path.is_file():
            out.append(entry)
    return out


def import_closure(tree: Path, entries: tuple[str, ...]) -> list[str]:
    """The Python files of ``entries`` and every dcpc file they import, transitively
    (less CPU_ONLY_FILES, neither read nor followed), sorted."""
    seen: set[str] = set()
    todo = [f for f in _python_files(tree, entries) if f not in CPU_ONLY_FILES]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for name in imported(tree, rel):
            found = _module_file(tree, name)
            if found is not None and found not in seen and found not in CPU_ONLY_FILES:
                todo.append(found)
    return sorted(seen)


def code_files(tree: Path) -> dict[str, list[str]]:
    """Each code part's files in ``tree``: "runtime", the closure of RUNTIME_ENTRY;
    "harness", the files under dcpc/harness of the closure of both entries; "reference",
    the rest of the closure of all three entries."""
    runtime = import_closure(tree, RUNTIME_ENTRY)
    run = import_closure(tree, RUNTIME_ENTRY + HARNESS_ENTRY + REFERENCE_ENTRY)
    harness = [f for f in run if f not in runtime and any(
        f.startswith(f"{entry}/") or f == entry for entry in HARNESS_ENTRY)]
    reference = [f for f in run if f not in runtime and f not in harness]
    return {"runtime": runtime, "harness": harness, "reference": reference}


def code_keys(tree: Path) -> dict[str, str]:
    """Each code part: sha256 over its files in ``tree`` (names and bytes, less the
    CPU-only parts)."""
    return {part: files_key(tree, files) for part, files in code_files(tree).items()}


def files_key(tree: Path, files: list[str]) -> str:
    """sha256 over ``files`` (paths in ``tree``): each one's name and bytes as the key
    reads them; a file ``tree`` lacks counts as missing, not as an error."""
    h = hashlib.sha256()
    for rel in sorted(files):
        if rel in CPU_ONLY_FILES:
            continue
        text = _text(tree, rel) if (tree / rel).is_file() else b"\0missing"
        h.update(f"{rel}\0{len(text)}\0".encode())
        h.update(text)
    return h.hexdigest()


def tree_digest(tree: Path) -> str:
    """sha256 of every file the keys of ``tree``'s cases may depend on: dcpc, templates,
    the schedule folders and this script (names and bytes)."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for folder in ("dcpc", "templates", "schedules"):
        for path in sorted((tree / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(f"{path.relative_to(tree).as_posix()}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def case_id(file: str, world: str) -> str:
    return f"{file}@{world}"


def module_keys(tree: Path, cases: list[tuple[str, str]]) -> dict[str, str | None]:
    """sha256 of the module ``dcpc.harness.run.compile_to`` (what `dcpc run` runs) writes
    for each (file, world), with the dcpc already imported (``tree``'s)."""
    from dcpc.harness.run import compile_to
    from dcpc.lang.mesh import MeshWorld

    out: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="dcpc-keys-") as tmp:
        for file, world in cases:
            w = MeshWorld([int(x) for x in world.split("x")]) if "x" in world else int(world)
            try:
                _, module, _, _ = compile_to(str(tree / file), Path(tmp), w)
                out[case_id(file, world)] = _sha(Path(module).read_bytes())
            except Exception:  # noqa: BLE001 - that tree cannot compile it: no key
                out[case_id(file, world)] = None
    return out


def main() -> int:
    tree = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(tree))
    import dcpc

    if not Path(dcpc.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"gpu_keys: imported {dcpc.__file__}, not {tree}'s dcpc")
    cases = [(f, str(w)) for f, w in json.load(sys.stdin)]
    print(json.dumps({**code_keys(tree), "modules": module_keys(tree, cases)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
