"""What a GPU conformance case runs, as a key of three parts: "module", the sha256 of
the module `dcpc run` compiles for the file at that world; "runtime" and "harness", the
sha256 of the code the run executes besides the module (CODE_PATHS). Two runs with equal
keys ran the same code (benchmarks/gpu_pending.py settles a case by it;
gpu_conformance.py records it in every record).

    python3 benchmarks/gpu_keys.py TREE < cases.json   # [[file, world], ...] -> keys JSON

computes the keys with TREE's own compiler (TREE first on sys.path: a checkout, or a
commit's `git archive` unpacked): {"runtime": sha, "harness": sha, "modules":
{"file@world": sha | null}}
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

# What a `dcpc run --device cuda --backend local` case executes besides its module: the
# runtime package the module imports (dcpc.runtime, its device library included) and the
# harness that drives the ranks, makes their inputs and compares their outputs
# (dcpc.harness), each a part of the key (a pending case names the part that changed).
# Left out: the float64 reference's per-op semantics (dcpc.ops, which every CPU run
# checks against the same module) and the compiler (its work shows in the module's bytes).
CODE_PATHS = {"runtime": ("dcpc/runtime",), "harness": ("dcpc/harness",)}
# Never executed on a GPU: imported or called only where the device is the CPU.
# dcpc.harness.interpret: worker.run_rank imports it under `device == "cpu"`;
# dcpc.runtime.local's interpreter shim: worker.run_rank installs it under
# `device == "cpu"`, LocalGroup only when its device is not cuda (tests/run/
# test_gpu_pending.py checks every call of these names stays behind such a test).
CPU_ONLY_FILES = ("dcpc/harness/interpret.py",)
CPU_ONLY_DEFS = {"dcpc/runtime/local.py": ("_install_interpreter_threads",
                                           "_lazy_tuple_types", "_np_dtype_memo")}


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


def code_keys(tree: Path) -> dict[str, str]:
    """Each CODE_PATHS part: sha256 over its Python files in ``tree`` (names and bytes),
    less the CPU-only parts."""
    return {part: _files_key(tree, folders) for part, folders in CODE_PATHS.items()}


def _files_key(tree: Path, folders: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted((tree / folder).rglob("*.py")):
            rel = path.relative_to(tree).as_posix()
            if rel in CPU_ONLY_FILES:
                continue
            text = path.read_bytes()
            if rel in CPU_ONLY_DEFS:
                text = without_defs(text.decode("utf-8"), CPU_ONLY_DEFS[rel]).encode()
            h.update(f"{rel}\0{len(text)}\0".encode())
            h.update(text)
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
