"""The ops' layer, read from the code as tests/support/import_graph.py reads it (imports at the
top, under TYPE_CHECKING and inside functions alike):

- an op module (one that defines an op of ``dcpc.ops.OPS``) imports, of dcpc, only the leaves in
  ``LEAVES`` and the ops' helpers (the other modules of dcpc/ops: cast, _merge, _reduce);
  a helper imports only the leaves: no op imports another op, a stage (check, harness,
  codegen), or the language above the ops (lang/model, sizes, questions, semantics);
- the leaves reach no op module nor helper, whatever they import in turn;
- no module of the circle of 28 the ops used to tie is in an import circle.

Before: the ops imported check/ops.Verify, harness/simulate.Sim, check/context.Ref and
lang/model.Schedule for their types, ops/common took OPS from the registry, reduce took
all_reduce's and broadcast's helpers, and those 28 modules formed one circle."""

from __future__ import annotations

from support import import_graph as G
from support.import_graph import RUNTIME_SHARED

import dcpc.ops

# What an op module may import of dcpc: the facts and the op API below the ops. (Its
# lowering rule sees dcpc.codegen.ctx.Ctx, which reads lang.model, only through
# dcpc.ops.iface.LowerRules, typed on lang.nodes' ScheduleView.)
LEAVES = frozenset({
    "dcpc.diagnostics", "dcpc.numerics", "dcpc.topology",
    "dcpc.exprs",  # the expression values under dcpc.lang.expr (stdlib only), and the
                   # ragged slots the compiler and the runtime share (ragged_slot)
    "dcpc.lang.expr", "dcpc.lang.nodes", "dcpc.lang.mesh",
    "dcpc.lang.when",  # a step's `when:` per rank (running): only the leaves above under it;
                       # shift's wait-first span runs each rank's guarded steps
    "dcpc.ops.common", "dcpc.ops.registry", "dcpc.ops.iface",
})

# the modules that define an op (its model's module), not dcpc.ops.MODULES: that tuple
# orders the first ops only, and an op added later (pull, sum) is not named in it
OP_MODULES = frozenset(op.model.__module__ for op in dcpc.ops.OPS.values())


# The circle the ops tied until the layers were drawn (tests/support/import_graph.py): every
# module of dcpc/ops (new ones included) and these.
WAS_TIED = ("dcpc.check.context", "dcpc.check.ops", "dcpc.harness.simulate",
            "dcpc.lang.exact", "dcpc.lang.mesh", "dcpc.lang.model", "dcpc.lang.questions",
            "dcpc.lang.semantics", "dcpc.lang.sizes")


def _helpers(known: set[str]) -> set[str]:
    """The modules of dcpc/ops that are neither an op, a leaf nor the package."""
    return {n for n in known if n.startswith("dcpc.ops.")} - OP_MODULES - LEAVES


def test_an_op_module_imports_only_the_leaves_and_the_helpers() -> None:
    edges = G.graph(["dcpc"])
    helpers = _helpers(set(edges))
    assert OP_MODULES <= set(edges)
    found = [f"{name} imports {target}"
             for name in sorted(OP_MODULES) for target in sorted(edges[name])
             if target not in LEAVES | helpers]
    found += [f"helper {name} imports {target}"
              for name in sorted(helpers) for target in sorted(edges[name])
              if target not in LEAVES]
    assert found == [], found


def test_the_leaves_reach_no_op() -> None:
    edges = G.graph(["dcpc"])
    above = OP_MODULES | _helpers(set(edges)) | {"dcpc.ops"}
    seen: set[str] = set()
    todo = [leaf for leaf in LEAVES if leaf in edges]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(edges[name])
    assert sorted(seen & above) == []


def test_no_module_of_the_ops_old_circle_is_in_a_circle() -> None:
    tied = sorted(name for circle in G.circles(G.graph(["dcpc"])) for name in circle
                  if name in WAS_TIED or name == "dcpc.ops" or name.startswith("dcpc.ops."))
    assert tied == [], tied


def test_no_import_circle_in_dcpc_or_benchmarks() -> None:
    """Issue 32: 0 circles (TYPE_CHECKING imports counted); a new one names its modules."""
    found = G.circles(G.graph(["dcpc", "benchmarks"]))
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_runtime_imports_no_compiler_code() -> None:
    """dcpc.runtime reaches, outside itself, only RUNTIME_SHARED, which import nothing
    of dcpc: a generated module needs none of the compiler (tests/run/test_run_cli.py runs
    one with pydantic, networkx, jinja2, yaml and click made unimportable)."""
    edges = G.graph(["dcpc"])
    outside = {b for a, bs in edges.items() if a.startswith("dcpc.runtime")
               for b in bs if not b.startswith("dcpc.runtime")}
    assert outside <= RUNTIME_SHARED, sorted(outside - RUNTIME_SHARED)
    assert {b for m in RUNTIME_SHARED for b in edges.get(m, ())} <= {"dcpc"}
