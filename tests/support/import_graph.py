"""The import structure of a package tree, read from the code: every module of the
folders asked and every ``import`` / ``from ... import`` in it (at the top, under
``if TYPE_CHECKING:``, inside a function: a reader follows them all), resolved to the
modules of the same tree; then its circles (strongly connected components of more than
one module, or a module importing itself).

    python tests/support/import_graph.py dcpc benchmarks     # prints every circle, exits 1 if any

Used by tests/codegen/test_layers.py."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(folders: list[str], root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file for every .py file under ``folders`` (``pkg/__init__.py`` is
    ``pkg``)."""
    out: dict[str, Path] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies inside (``a.b.c`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tree's modules that module ``name`` imports, anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)] if node.level > 1 else up
                base = ".".join([*up, base] if base else up)
            # `from pkg import mod` imports the module pkg.mod when there is one
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            hit = _resolve(target, known)
            if hit is not None and hit != name and not (
                    isinstance(node, ast.ImportFrom) and target == base
                    and any(_resolve(f"{base}.{a.name}", known) not in (None, base)
                            for a in node.names)):
                found.add(hit)
    return found


def graph(folders: list[str], root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(folders, root)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each
    sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def main(argv: list[str]) -> int:
    folders = argv or ["dcpc", "benchmarks"]
    found = circles(graph(folders))
    for component in found:
        print(f"circle of {len(component)}: {', '.join(component)}")
    print(f"{len(found)} import circle(s) in {', '.join(folders)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# What the runtime (and so a generated module) may import of dcpc outside dcpc.runtime:
# leaves of the standard library and torch only, which the compiler shares.
RUNTIME_SHARED = frozenset({"dcpc", "dcpc.exprs", "dcpc.numerics", "dcpc.topology",
                            "dcpc.tuning"})
