"""The adapters' import structure (dcpc/engines), read from the code as
tests/support/import_graph.py reads it (imports at the top, under TYPE_CHECKING and
inside functions alike):

- no import circle among the engines' modules;
- the vLLM plugin face (dcpc.engines.vllm: install() and the names that mirror vLLM's)
  is imported by no module of dcpc: its helpers sit below it;
- no engines module reads another dcpc module's private name (``from m import _x``,
  ``m._x``, ``C._x`` of a class ``C`` it imports): the runner table, the switches and
  vLLM's saved functions are read through functions.

Before: dcpc.engines.agree and dcpc.engines.combine imported each other (agree's refuse
read combine's ``_runners`` and ``_runners_lock``), and vllm, vllm_install, vllm_kv,
vllm_manager, capture and contract formed one circle of 8 (the helpers took switches
and ``_combine``, ``_engine_fallback``, ``_ubatch`` from the face); vllm_kv borrowed
``MLADCPManager._kv_runner`` and ``._agree`` (issue 32: now vllm_manager's ``kv_runner``;
``_agree`` was never called there)."""

from __future__ import annotations

import ast

from support import import_graph as G

FACE = "dcpc.engines.vllm"


def _engines(names: list[str] | set[str]) -> list[str]:
    return sorted(n for n in names if n == "dcpc.engines" or n.startswith("dcpc.engines."))


def test_no_import_circle_in_the_engines() -> None:
    edges = G.graph(["dcpc"])
    tied = [c for c in G.circles(edges) if _engines(c)]
    assert tied == [], tied


def test_no_module_imports_the_vllm_plugin_face() -> None:
    edges = G.graph(["dcpc"])
    assert FACE in edges
    importers = sorted(name for name, targets in edges.items() if FACE in targets)
    assert importers == [], importers


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_reads(name: str, known: dict) -> list[str]:
    """Where module ``name`` reads a private name of another dcpc module."""
    path = known[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    modules: set[str] = set()  # local names bound to a dcpc module or to a name of one
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dcpc"):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import "
                                 f"{alias.name}")
                modules.add(alias.asname or alias.name)  # a module, a class, a function
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    modules.add(alias.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in modules and _private(node.attr):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_engines_module_reads_a_private_name_of_another() -> None:
    known = G.modules(["dcpc"])
    found = [hit for name in _engines(set(known)) for hit in _private_reads(name, known)]
    assert found == [], found
