"""Stage 4, lower: ``Schedule`` -> ``Plan``, one lowering rule per op.

An op's rule is its ``OpDef.lower``, in its module dcpc/ops/<op>.py (JAX's
register_lowering style, with the registry below the ops): it gets a ``Ctx``
(dcpc/codegen/ctx.py; the ops see it as dcpc.ops.iface.LowerRules) and the step and
returns its ``StepPlan``, whose template is templates/ops/<op>.py.j2. This driver
runs them and adds what every step's plan gets: launch defaults, effects and sync.
How to add an op: docs/internals.md.

Every rule views its buffers through canonical factors (products of shape ASTs), so
that one kernel template serves every layout: e.g. an all_gather along ``dim`` sees
``src`` as ``[outer, rows, row_len]`` and ``dst`` as ``[outer, W * rows, row_len]``.
"""

from __future__ import annotations

import ast
import keyword
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import dcpc
from dcpc.codegen.ctx import DEFAULT_TUNING, OP_TUNING, Ctx
from dcpc.codegen.plan import BufferPlan, Plan, SizePlan, StepPlan
from dcpc.codegen.templates import template_dir
from dcpc.diagnostics import DiagnosticError
from dcpc.lang import expr as ex
from dcpc.lang import model as m
from dcpc.lang import when as wh
from dcpc.lang.loops import ROTATION, rotations
from dcpc.lang.mesh import mesh_of
from dcpc.lang.semantics import Semantics, table
from dcpc.ops import OPS

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
RUNTIME_MODULE = Path(dcpc.__file__).resolve().parent / "runtime" / "module.py"


# Every local the emitted code introduces starts with '_', and schedule, buffer and step
# names may not (dcpc.check.names): no schedule name can reach them. What remains is read
# from the code itself, never typed here: a step becomes a method next to what the base
# class gives, a buffer a parameter next to the method's own ones.
@lru_cache(maxsize=1)
def base_class_names() -> frozenset[str]:
    """The public API of ``dcpc.runtime.ScheduleModule`` (methods, class attributes and
    the attributes its methods set on ``self``), read from its source with ``ast``: the
    compiler never imports torch. A step of that name would hide it."""
    tree = ast.parse(RUNTIME_MODULE.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ScheduleModule"]
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return frozenset(n for n in names if not n.startswith("_"))


@lru_cache(maxsize=1)
def method_names() -> frozenset[str]:
    """The parameters a generated method has besides its buffers (self, slot, sizes),
    read from the signature in templates/module.py.j2."""
    text = (template_dir() / "module.py.j2").read_text(encoding="utf-8")
    found = re.search(r"def \{\{ step\.name \}\}\((.*?)\n    \) ->", text, re.S)
    if found is None:
        raise RuntimeError("templates/module.py.j2: no method signature found")
    return frozenset(re.findall(r"^ +([A-Za-z_]\w*)\b(?=:|,)", found[1], re.M))


@lru_cache(maxsize=1)
def module_imports() -> frozenset[str]:
    """The top-level modules the emitted module imports (read from the template): a
    module ``<schedule>.py`` of one of these names would shadow it."""
    text = (template_dir() / "module.py.j2").read_text(encoding="utf-8")
    return frozenset(re.findall(r"^(?:from|import) ([A-Za-z_]\w*)", text, re.M))


# pycodestyle's E741-E743 (the project's ruff rules): names that read as 1 or 0 may
# not name a variable, a function or a class of the generated module.
AMBIGUOUS = frozenset({"l", "O", "I"})


def class_name(schedule: str) -> str:
    """The generated class: the CamelCase form of the schedule name (kimi_k3 -> KimiK3)."""
    return "".join(part[:1].upper() + part[1:] for part in schedule.split("_"))


def _buffers(schedule: m.Schedule) -> dict[str, BufferPlan]:
    written = schedule.method_outputs()
    out = {}
    for name, b in schedule.buffers.items():
        whole = schedule.module_view_of(name)
        if whole is not None:
            # a chunk of the module's symmetric memory: the engine's view of it
            out[name] = BufferPlan(name, [ex.parse(d) for d in b.shape], b.dtype.value,
                                   "engine", view_of=whole,
                                   view_axis=schedule.slice_axis(whole),
                                   view_index=schedule.slice_of(name)[1])
            continue
        kind = (
            "shared"
            if b.shared
            else "symmetric"
            if b.symmetric
            else ("output" if name in written else "engine")
        )
        out[name] = BufferPlan(
            name, [ex.parse(d) for d in b.shape], b.dtype.value, kind, b.lse_base, b.persist
        )
    return out


def _sizes(schedule: m.Schedule) -> list[SizePlan]:
    axes = mesh_of(schedule).size_names() if schedule.mesh else {}
    out = [SizePlan(name, "axis", position) for name, position in axes.items()]
    for name, spec in schedule.sizes.items():
        if name in axes:
            continue
        if isinstance(spec, int):
            out.append(SizePlan(name, "const", spec))
        elif spec.max is not None:
            out.append(SizePlan(name, "max", spec.max))
        else:
            assert spec.multiple_of is not None  # the model requires max or multiple_of
            out.append(SizePlan(name, "multiple_of", None, ex.parse(spec.multiple_of)))
    return out


def _check_names(ctx: Ctx) -> None:
    """What the generated module needs of names (dcpc.check.names gives the user the
    same rules first): identifiers that do not start with '_' and hide nothing."""
    s = ctx.schedule

    def bad(name: str) -> bool:
        return not IDENT.match(name) or keyword.iskeyword(name) or name.startswith("_")

    if bad(s.schedule) or keyword.iskeyword(class_name(s.schedule)) or (
        class_name(s.schedule) in AMBIGUOUS
    ):
        ctx.fail(
            s.mark("schedule"),
            "bad-identifier",
            f"schedule name {s.schedule!r} cannot name the generated module and its class "
            f"{class_name(s.schedule)!r}",
        )
    for name in s.buffers:
        if bad(name) or name in method_names() or name in AMBIGUOUS:
            ctx.fail(
                s.mark(f"buffers/{name}", of_key=True),
                "reserved-name",
                f"buffer name {name!r} cannot be a parameter of the generated methods "
                f"(not an identifier, a keyword, a name starting with '_', or one of "
                f"{', '.join(sorted(method_names()))})",
                f"rename it, e.g. '{name.strip('_')}_buf'" if IDENT.match(name) else None,
            )
    for step in ctx.steps:
        if bad(step.name) or step.name in base_class_names() or step.name in AMBIGUOUS:
            ctx.fail(
                step.mark(),
                "reserved-name",
                f"step name {step.name!r} cannot be a method of the generated class",
                f"rename it, e.g. '{step.name.strip('_')}_step'",
            )


def _contract(plan_steps: list[StepPlan], slots: int, streams: str,
              buffers: Iterable[BufferPlan] = ()) -> list[str]:
    order = " -> ".join(f"[{s.name}]" if s.op == "external" else f"{s.name}()" for s in plan_steps)
    lines = [
        f"per call, on every rank, in this order: {order}",
        "[bracketed] steps are the engine's own kernels, run between those calls",
        "every rank makes the same calls, in the same order, with the same sizes",
        f"call i uses slot=i % {slots}" if slots > 1 else "there is one slot: slot=0",
    ]
    if streams == "per_slot":
        lines.append(
            "streams: per_slot: a slot's calls are ordered on one stream; slots may overlap"
        )
    else:
        lines.append("streams: single: every call runs on one stream, one after another")
    for s in plan_steps:
        if s.op == "external":
            lines.append(
                f"{s.name} reads {', '.join(s.reads) or 'nothing'}; "
                f"writes {', '.join(s.writes) or 'nothing'}"
                + (f"; only where {ex.unparse(s.attrs['when'])} (runs('{s.name}'))"
                   if "when" in s.attrs else "")
            )
    buffers = list(buffers)
    for base, turns in rotations(b.name for b in buffers).items():
        held = ", ".join(ROTATION.format(base, c) for c in turns)
        lines.append(
            f"{base} (symmetric, leading axis W) is held as {held}: on rank r, "
            f"{ROTATION.format(base, '<c>')} is slot (r + c) mod W of {base} (an index "
            f"that rotates the rank); there is no buffer {base}: module.buffer("
            f"'{ROTATION.format(base, '<c>')}')"
        )
    for b in buffers:
        if b.view_of is not None:
            lines.append(
                f"{b.name} is module.buffer('{b.view_of}').select({b.view_axis}, "
                f"{b.view_index}): a view of the module's memory, which allocates none "
                "for it")
    for b in buffers:
        if b.persist:
            lines.append(
                f"{b.name} persists: one instance for all slots, zeros at construction, "
                "never reset by a call (call k reads what call k - 1 left); to reset it, "
                f"write module.buffer('{b.name}') on every rank, all ranks together, "
                "while no call of any peer is in flight; warm-up calls (CUDA-graph "
                "warm-up makes eager calls: dcpc.engines.capture) advance it: reset "
                "after warm-up"
            )
    return lines


def lower(schedule: m.Schedule, worlds: Iterable[int],
          semantics: list[Semantics] | None = None) -> Plan:
    """Lower a checked schedule to a kernel plan (raises DiagnosticError if it cannot);
    ``semantics``: the schedule's table, asked when not given."""
    ctx = Ctx(schedule, _buffers(schedule))
    _check_names(ctx)
    semantics = table(schedule, semantics)
    steps = []
    for step in ctx.steps:
        plan = OPS[step.kind].lower(ctx, step)
        if plan.template is not None and not plan.tuning:
            plan.tuning = {**DEFAULT_TUNING, **OP_TUNING.get(step.kind, {})}
        plan.effects = list(semantics[step.index].effects)
        plan.sync = semantics[step.index].sync  # polls None: a wait nothing signals (emit refuses)
        cond = wh.condition(step)
        if cond is not None:  # when: the module's WHEN, and the method's early return
            plan.attrs["when"] = cond
        steps.append(plan)
    if ctx.errors:
        raise DiagnosticError(ctx.errors)
    name = schedule.schedule
    return Plan(
        schedule=name,
        class_name=class_name(name),
        version=dcpc.__version__,
        source_sha256=schedule.source_sha256,
        source_name=schedule.source_file.replace("\\", "/").rsplit("/", 1)[-1],
        worlds=sorted(set(worlds)),
        slots=schedule.slots,
        loop_world=schedule.loop_world,
        streams=schedule.streams.value,
        doc=schedule.doc,
        sizes=_sizes(schedule),
        buffers=list(ctx.buffers.values()),
        steps=steps,
        contract=_contract(steps, schedule.slots, schedule.streams.value,
                           ctx.buffers.values()),
        mesh=tuple(schedule.mesh.items()) if schedule.mesh else (),
    )
