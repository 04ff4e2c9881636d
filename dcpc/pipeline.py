"""The driver: the compiler's stages in one ordered table, each making its product.

    parse  -> schedule, worlds, semantics   (the table every later stage reads)
    graph  -> graph                         (the dataflow graph)
    check  -> warnings                      (structural errors stop here)
    lower  -> plan
    hb     -> hb_report                     (races and deadlocks stop here)
    emit   -> module_text

    a file whose unrolled steps name W, several W asked:
    per W  -> Worlds                        (each W through parse .. hb on its own)
    emit   -> module_text                   (one class per W)

Each stage is a function of the products before it (and the options), kept in the
fields of ``Compilation`` that ``STAGES`` names; a stage that cannot go on raises
DiagnosticError. ``run(..., until=NAME)`` stops after a
stage, which gives ``dcpc compile --dump NAME`` and one test per stage for free.
``dcpc check`` runs up to ``hb``, ``dcpc compile`` to ``emit``: what check accepts,
compile accepts.

The happens-before stage comes after ``lower`` because it analyses the plan: the
signal slots and epochs the emitted kernels use, not an idea of the schedule.
Warnings are collected in ``Compilation.warnings`` and never stop a stage, unless
``Options.strict`` makes them errors.

Each stage's product is a field of ``Compilation``; ``run_plan`` enters the table
with a given product: a plan dumped by ``--dump lower`` (dcpc.codegen.plan
``load_plan``) is proved against its schedule (parse, check, the schedule's own
lowering, which it must be but for each step's tuning, hb on the loaded
plan) and emitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcpc.diagnostics import Diagnostic, DiagnosticError
from dcpc.lang.mesh import DEFAULT_WORLDS

if TYPE_CHECKING:  # the stages' products, typed; imported where a stage runs
    import networkx as nx

    from dcpc.check.hb import HbReport
    from dcpc.codegen.plan import Plan
    from dcpc.lang.model import Schedule
    from dcpc.lang.semantics import Semantics


@dataclass
class Options:
    worlds: Sequence[int] = DEFAULT_WORLDS
    hb: bool = True  # run the happens-before checker after the lowering
    strict: bool = False  # warnings are errors


@dataclass
class Compilation:
    """What the stages produced for one schedule file."""

    path: Path
    options: Options
    schedule: Schedule | None = None  # parse
    # parse: every step's effects and sync (dcpc.lang.semantics.table), which the later
    # stages read: made once per schedule
    semantics: list[Semantics] | None = None
    # a trip count that names W: the worlds checked one at a time (dcpc.lang.loops);
    # the other fields then hold the last W's results
    per_world: list[int] = field(default_factory=list)
    per_world_line: int = 0  # where the file first names W (its line), with per_world
    graph: nx.DiGraph | None = None  # graph
    hb_report: HbReport | None = None  # hb
    plan: Plan | None = None  # lower
    module_text: str | None = None  # emit
    warnings: list[Diagnostic] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    worlds: list[int] = field(default_factory=list)  # the group sizes, as the mesh reads them
    # a file checked per W: its loaded YAML and text hash, read once for every W
    source: tuple[Any, str] | None = None


def default_worlds(schedule: Any) -> list[int]:
    """The group sizes checked when none are asked: W 2..8 (a mesh of one axis: at most
    its size's max), or for a mesh of several axes every shape with each axis sized by
    a name in 2..4 (at most its max; an int axis: its size)."""
    from dcpc.lang.mesh import mesh_of

    mesh = mesh_of(schedule)
    maxima = {name: spec.max for name, spec in schedule.sizes.items()
              if getattr(spec, "max", None) is not None}
    return _defaults(mesh, maxima)


def _defaults(mesh: Any, maxima: dict[str, int]) -> list[int]:
    from dcpc.lang.mesh import MeshWorld, default_shapes

    if len(mesh.axes) > 1:
        return list(default_shapes(mesh, maxima))
    size = mesh.sizes[0]
    if not mesh.declared or not isinstance(size, str) or size not in maxima:
        return [mesh.world((w,)) for w in (DEFAULT_WORLDS if not isinstance(size, int)
                                           else (size,))]
    top = min(DEFAULT_WORLDS[-1], maxima[size])
    return [MeshWorld((w,)) for w in range(DEFAULT_WORLDS[0], top + 1)] or [MeshWorld((top,))]


def _raw_defaults(data: Any) -> list[int]:
    """``default_worlds`` from the loaded YAML of a file that is parsed once per W (a
    mesh of several axes: shapes, not W 2..8); a mesh that is no mapping of names and
    sizes gets W 2..8, and the parse of its first W reports it."""
    from dcpc.lang.mesh import MAX_AXES, Mesh
    from dcpc.lang.yamlsrc import strip

    raw = strip(data.get("mesh")) if isinstance(data, dict) else None
    if not isinstance(raw, dict) or not raw or len(raw) > MAX_AXES or not all(
            isinstance(k, str) and isinstance(v, (str, int)) and not isinstance(v, bool)
            for k, v in raw.items()):
        return list(DEFAULT_WORLDS)
    sizes = strip(data.get("sizes"))
    maxima = {k: v["max"] for k, v in (sizes.items() if isinstance(sizes, dict) else ())
              if isinstance(v, dict) and isinstance(v.get("max"), int)}
    return _defaults(Mesh(tuple(raw), tuple(raw.values()), True), maxima)


def first_default_world(path: str | Path) -> int:
    """The smallest group size ``dcpc check`` checks a file at by default: W=2, or its
    mesh's smallest default shape (2x2): what a command of one group size uses when
    none is given. A file that cannot be read or loaded gets 2 (its parse says why)."""
    from dcpc.files import read_capped
    from dcpc.lang import yamlsrc
    from dcpc.lang.parse import MAX_FILE_BYTES

    try:
        data = yamlsrc.load(read_capped(Path(path), MAX_FILE_BYTES).decode("utf-8"), str(path))
    except (DiagnosticError, UnicodeDecodeError):
        return DEFAULT_WORLDS[0]
    return _raw_defaults(data)[0]


def _parse(c: Compilation) -> tuple[Schedule, list[int], list[Semantics]]:
    """The schedule (its loops unrolled), the group sizes as its mesh reads them, and
    its semantics table (dcpc.lang.semantics): every later stage reads that table."""
    from dcpc.lang.parse import parse_file
    from dcpc.lang.semantics import table

    worlds = list(c.options.worlds)
    world = worlds[0] if len(worlds) == 1 else None
    if c.source is None:
        schedule = parse_file(c.path, world=world)
    else:
        from dcpc.lang.parse import parse_loaded

        raw, digest = c.source
        schedule = parse_loaded(_tree_copy(raw), digest, str(c.path), world)
    try:
        fitted = _fit_worlds(schedule, c.options.worlds)
    except DiagnosticError as err:  # the schedule is kept: what the stages got to
        err.product = (schedule, c.worlds, None)  # type: ignore[attr-defined]
        raise
    return schedule, fitted, table(schedule)


def _tree_copy(data: Any) -> Any:
    """A copy of loaded YAML's mappings and lists (its leaves, strings, numbers and
    frozen marks, are shared): what the parse of one W may annotate in place."""
    if isinstance(data, dict):
        return {k: _tree_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_tree_copy(v) for v in data]
    return data


def _fit_worlds(s: Schedule, asked: Sequence[int]) -> list[int]:
    """The asked group sizes as the schedule's mesh reads them (dcpc.lang.mesh); a
    shape that does not fit the mesh is a located ``bad-world``."""
    from dcpc.check.mesh import mesh_diagnostics
    from dcpc.diagnostics import Mark
    from dcpc.lang.mesh import WorldError, fit_worlds, mesh_of

    broken = mesh_diagnostics(s)  # every group size is read through the mesh
    if broken:
        raise DiagnosticError(broken)
    if asked is DEFAULT_WORLDS:
        return default_worlds(s)
    try:
        return sorted(set(fit_worlds(mesh_of(s), asked)))
    except WorldError as err:
        mark = s.mark("mesh") if s.mesh is not None else Mark(s.source_file, 1, 1)
        raise DiagnosticError([Diagnostic(mark, "bad-world", str(err))]) from None


def _graph(c: Compilation) -> nx.DiGraph:
    from dcpc.graph import dataflow

    return dataflow(c.schedule, c.semantics)


def _check(c: Compilation) -> list[Diagnostic]:
    """The structural checks' warnings; their errors (with --strict, any warning too)
    stop the table, the warnings kept as the product."""
    from dcpc.check import structural

    found = structural.check(c.schedule, c.worlds, c.semantics)
    warnings = [d for d in found if d.severity == "warning"]
    if (c.options.strict and warnings) or any(d.severity == "error" for d in found):
        raise _stop(found, warnings)
    return warnings


def _lower(c: Compilation) -> Plan:
    from dcpc.codegen.lower import lower

    return lower(c.schedule, c.worlds, c.semantics)


def _hb(c: Compilation) -> HbReport | None:
    """The happens-before report of the plan; its races and deadlocks stop the table,
    the report kept (``dcpc check --format json`` prints it)."""
    if not c.options.hb:
        return None
    from dcpc.check import hb

    report = hb.check(c.schedule, c.worlds, plan=c.plan, semantics=c.semantics)
    found = report.diagnostics()
    if found:
        raise _stop(found, report)
    return report


def _emit(c: Compilation) -> str:
    from dcpc.codegen.emit import emit

    return emit(c.plan)


def _stop(found: list[Diagnostic], product: Any) -> DiagnosticError:
    """A stage's refusal that still hands on its product (``_stages`` keeps it)."""
    err = DiagnosticError(found)
    err.product = product  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True)
class Stage:
    """One stage: its name (``until``, ``--dump``), the function that makes its product
    from the products before it, and the fields of ``Compilation`` that hold it."""

    name: str
    make: Callable[[Compilation], Any]
    product: tuple[str, ...]


STAGES: tuple[Stage, ...] = (
    Stage("parse", _parse, ("schedule", "worlds", "semantics")),
    Stage("graph", _graph, ("graph",)),
    Stage("check", _check, ("warnings",)),
    Stage("lower", _lower, ("plan",)),
    Stage("hb", _hb, ("hb_report",)),
    Stage("emit", _emit, ("module_text",)),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def run(path: str | Path, options: Options | None = None, until: str = "emit",
        source: tuple[Any, str] | None = None) -> Compilation:
    """Run the stages in order up to and including ``until`` (``source``: the file's
    loaded YAML and text hash, when the caller has read it already)."""
    if until not in STAGE_NAMES:
        raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGE_NAMES)}")
    c = Compilation(Path(path), options or Options(), source=source)
    loop = _world_loop(c)  # a loop whose trip count names W: the per-W stage
    if loop is not None:
        return _per_world(c, loop, until)
    return _stages(c, STAGE_NAMES[0], until)


def run_plan(path: str | Path, plan_path: str | Path, options: Options | None = None,
             until: str = "emit") -> Compilation:
    """Emit the plan dumped in ``plan_path`` (``dcpc compile --dump lower``) for the
    schedule file ``path``, once it is proved: the file is the one the plan was
    lowered from (its sha256), the schedule checks at the plan's worlds, the plan is
    the schedule's lowering at those worlds (lowered again here) in every field but
    each step's ``tuning`` (dcpc.codegen.plan ``EDITABLE``), which holds knobs in
    bounds (``editable_fault``), and the happens-before checker accepts the loaded
    plan. Nothing else of
    the file reaches the module. Anything else is a DiagnosticError located in one of
    the two files."""
    from dataclasses import replace

    from dcpc.codegen.plan import MAX_PLAN_BYTES, PlanFormatError, editable_fault, load_plan
    from dcpc.diagnostics import Mark
    from dcpc.files import read_capped

    at = Mark(str(plan_path), 1, 1)
    try:
        plan = load_plan(read_capped(plan_path, MAX_PLAN_BYTES))
    except PlanFormatError as exc:
        raise DiagnosticError([Diagnostic(
            at, "bad-plan", f"not a plan that this dcpc dumps: {exc}",
            hint="dump it again with dcpc compile FILE -o DIR --dump lower")]) from None
    bad = _bad_worlds(plan.worlds)
    if bad:
        raise DiagnosticError([Diagnostic(at, "bad-plan", f"{bad} (at plan.Plan.worlds)")])
    c = Compilation(Path(path), replace(options or Options(), worlds=plan.worlds, hb=True))
    _stages(c, "parse", "parse")
    if c.schedule.source_sha256 != plan.source_sha256:
        raise DiagnosticError([Diagnostic(
            at, "plan-stale", f"the plan was lowered from a file whose sha256 is "
            f"{str(plan.source_sha256)[:64]}, not {c.path}'s ({c.schedule.source_sha256}): "
            "the schedule changed since the plan was dumped",
            hint="dump the plan again from this file")])
    _stages(c, "graph", "check")
    lowered = _lower(c)  # what a plain compile at the plan's worlds emits
    mismatch = _plan_mismatch(c, plan, lowered)
    if mismatch:
        raise DiagnosticError([Diagnostic(
            at, "plan-mismatch", f"the plan's {mismatch[0]} is not what {c.path} declares"
            + (f" (first at {mismatch[1]})" if mismatch[1] else ""),
            hint="edit only each step's tuning; dump the plan again with "
                 "dcpc compile FILE -o DIR --dump lower")])
    fault = editable_fault(plan, lowered)
    if fault:
        raise DiagnosticError([Diagnostic(
            at, "plan-mismatch", f"the plan's {fault[0]}: {fault[1]}",
            hint="dump the plan again with dcpc compile FILE -o DIR --dump lower")])
    c.plan = plan
    if until in STAGE_NAMES[STAGE_NAMES.index("hb"):]:
        try:
            _stages(c, "hb", until)
        except DiagnosticError:
            raise
        except Exception as exc:  # noqa: BLE001  (input: a plan no lowering makes)
            raise DiagnosticError([Diagnostic(
                at, "plan-mismatch", f"the plan cannot be analysed or emitted "
                f"({type(exc).__name__}: {str(exc)[:200]}); no lowering of {c.path} "
                "makes it")]) from None
    return c


def _bad_worlds(worlds: list[int]) -> str | None:
    """What is wrong with a loaded plan's worlds, by ``--world``'s rules (at least one;
    group sizes 2..MAX_WORLD; mesh shapes as dcpc.lang.mesh parses them)."""
    from dcpc.lang.mesh import MAX_WORLD, MeshWorld, WorldError, parse_shapes

    if not worlds:  # the proof is for the worlds the plan names: none proves nothing
        return "the plan names no worlds"
    for w in worlds:
        if isinstance(w, MeshWorld):
            try:
                parse_shapes("x".join(map(str, w.shape)), MAX_WORLD)
            except WorldError as err:
                return f"mesh shape {w}: {err}"
        elif not 2 <= w <= MAX_WORLD:
            return f"group size {w}: group sizes must lie in 2..{MAX_WORLD}"
    return None


def _plan_mismatch(c: Compilation, plan: Plan,
                   lowered: Plan) -> tuple[str, str | None] | None:
    """Where a loaded plan is not ``lowered``, the schedule's own lowering at its worlds:
    first the facts the lowering copies from the schedule, by name (the names, sizes,
    buffers, steps, effects, when and contract the module declares) and, for a field
    of the plan, the key path where it first differs; then any other difference by its
    key path (dcpc.codegen.plan ``plan_difference``: every field but
    each step's ``tuning``, which ``editable_fault`` judges)."""
    from dataclasses import fields

    import dcpc
    from dcpc.codegen.lower import _contract, _sizes, class_name
    from dcpc.codegen.plan import plan_difference
    from dcpc.lang.when import condition
    s = c.schedule
    facts: tuple[tuple[str, Any, Any], ...] = (
        ("version", plan.version, dcpc.__version__),  # the lowering rules are a version's
        ("source_name", plan.source_name, c.path.name),
        ("schedule", plan.schedule, s.schedule),
        ("class_name", plan.class_name, class_name(s.schedule)),
        ("worlds", plan.worlds, sorted(set(c.worlds))),
        ("slots", plan.slots, s.slots),
        ("loop_world", plan.loop_world, s.loop_world),
        ("streams", plan.streams, s.streams.value),
        ("doc", plan.doc, s.doc),
        ("mesh", plan.mesh, tuple(s.mesh.items()) if s.mesh else ()),
        ("sizes", plan.sizes, _sizes(s)),
        # the declared buffers, then the lowering's own (an implicit ``via``): all of them
        ("buffers", plan.buffers, lowered.buffers),
        ("steps", [(p.name, p.index, p.op) for p in plan.steps],
         [(p.name, p.index, p.kind) for p in s.step_list()]),
        # what the happens-before checker takes as each kernel's accesses (the kernels'
        # own come from roles, not from these): the op rules' (dcpc.lang.semantics);
        # the slots and epochs (``sync``) are the kernels' own, which the hb stage proves
        ("effects", [p.effects for p in plan.steps], [list(e.effects) for e in c.semantics]),
        # where each step runs (its ``when:``): the module's runs() and early returns
        ("when", [p.attrs.get("when") for p in plan.steps],
         [condition(step) for step in s.step_list()]),
        # free text that reaches the module: what the lowering derives from the steps
        ("contract", plan.contract,
         _contract(plan.steps, plan.slots, plan.streams, plan.buffers)),
    )
    for what, got, want in facts:
        if got != want or (what == "worlds" and [getattr(w, "shape", None) for w in got]
                           != [getattr(w, "shape", None) for w in want]):
            where = plan_difference(got, want, f"plan.Plan.{what}")
            held = what in {f.name for f in fields(plan)} and where  # a field's own value
            return what, where if held else None
    where = plan_difference(plan, lowered)
    return None if where is None else (where, None)


def _stages(c: Compilation, first: str, until: str) -> Compilation:
    """Run the stages from ``first`` up to and including ``until`` on ``c``, each
    stage's product kept in its fields of ``c``."""
    for stage in STAGES[STAGE_NAMES.index(first):]:
        start = time.perf_counter()
        try:
            _keep(c, stage, stage.make(c))
        except DiagnosticError as err:
            if hasattr(err, "product"):  # a refusal's product (_stop)
                _keep(c, stage, err.product)
                del err.product
            err.compilation = c  # type: ignore[attr-defined]  # what the stages got to
            if stage.name != "check":  # the check stage's error already lists its warnings
                err.diagnostics = sorted([*c.warnings, *err.diagnostics],
                                         key=lambda d: (d.mark, d.code))
            raise
        c.seconds[stage.name] = time.perf_counter() - start
        if stage.name == until:
            break
    return c


def _keep(c: Compilation, stage: Stage, product: Any) -> None:
    values = product if len(stage.product) > 1 else (product,)
    for name, value in zip(stage.product, values, strict=True):
        setattr(c, name, value)


def _per_world_budget(c: Compilation, mark: Any, done: list[Compilation]) -> None:
    """The happens-before work limit (dcpc.check.structural) over the W of a per-W file
    together, from each W's parsed schedule, before any W is analysed."""
    from dcpc.check.structural import MAX_HB_WORK, hb_cost
    from dcpc.diagnostics import Mark
    from dcpc.lang.mesh import worlds_text

    work = 0
    fits: list[int] = []
    for one in done:
        work += hb_cost(one.schedule, one.worlds, one.semantics).work
        if work <= MAX_HB_WORK:
            fits += one.worlds
    if work <= MAX_HB_WORK:
        return
    asked = [w for one in done for w in one.worlds]
    narrower = (f"check W {worlds_text(fits)} (or a few W at a time)" if fits
                else "check fewer W at a time")
    raise DiagnosticError([Diagnostic(
        Mark(str(c.path), mark.line, mark.col), "schedule-too-large",
        f"the unrolled steps depend on W ({NAMES_W}), "
        f"so each W is analysed on its own: W {worlds_text(asked)} make {work} units of "
        f"happens-before work in all, above the limit of {MAX_HB_WORK}; {narrower}")])


def _world_loop(c: Compilation) -> Any:
    """The mark of a loop whose trip count names W, when several worlds are asked (the
    file's loaded YAML is kept in ``c.source``: the file is read once)."""
    if len(list(c.options.worlds)) < 2:
        return None
    from dcpc.files import read_capped
    from dcpc.lang import loops, yamlsrc
    from dcpc.lang.parse import MAX_FILE_BYTES, sha256

    try:
        text = read_capped(c.path, MAX_FILE_BYTES).decode("utf-8")
    except (DiagnosticError, UnicodeDecodeError):
        return None  # the parse stage reports it
    data = yamlsrc.load(text, str(c.path))  # its error is the file's: not loaded twice
    c.source = (data, sha256(text))  # the parse stage (or each W's) starts from it
    return loops.world_dependent(data)


def _per_world_warnings(done: list[Compilation], worlds: list[int]) -> list[Diagnostic]:
    """The warnings of a file checked once per W, over all of them: one that every W
    gives is reported once; an unused buffer that some W uses is no warning (a ring of
    W - 2 hops leaves its body's buffers unused at W=2); any other that some W only
    gives names those W."""
    from dataclasses import replace

    from dcpc.lang.mesh import worlds_text

    held: dict[tuple[Any, str, str], list[int]] = {}
    first: dict[tuple[Any, str, str], Diagnostic] = {}
    for world, one in zip(worlds, done, strict=True):
        for d in one.warnings:
            key = (d.mark, d.code, d.message)
            held.setdefault(key, []).append(world)
            first.setdefault(key, d)
    out = []
    for key, where in held.items():
        d = first[key]
        if len(where) < len(worlds):
            if d.code == "unused-buffer":
                continue
            d = replace(d, message=f"{d.message} (at W {worlds_text(where)} of the W "
                                   f"checked, {worlds_text(worlds)})")
        out.append(d)
    return sorted(out, key=lambda d: (d.mark, d.code))


def _per_world_errors(failed: list[DiagnosticError]) -> DiagnosticError:
    """The errors of the W that failed, each distinct one once, in the order found."""
    if len(failed) == 1:
        return failed[0]
    seen: set[tuple[Any, str, str]] = set()
    found: list[Diagnostic] = []
    for err in failed:
        for d in err.diagnostics:
            if (d.mark, d.code, d.message) not in seen:
                seen.add((d.mark, d.code, d.message))
                found.append(d)
    merged = DiagnosticError(found)
    if hasattr(failed[0], "compilation"):
        merged.compilation = failed[0].compilation  # type: ignore[attr-defined]
    return merged


# what makes a file one schedule per W (dcpc.lang.loops.world_dependent), in messages
NAMES_W = "a trip count, an index, an offset, an interleave or a perm names W"


@dataclass
class Worlds:
    """The per-W stage's product, for a file whose unrolled steps name W (a trip count,
    an index or an offset): each W's own compilation, its stages run up to the one
    asked (``hb`` at most; the module of every W is emitted from them at once)."""

    loop: Any  # the mark of the loop that names W (dcpc.lang.loops.world_dependent)
    worlds: list[int]  # the W checked, in the order asked
    each: list[Compilation]  # one per W, in that order

    def merged(self, options: Options) -> Compilation:
        """The last W's compilation standing for every W: the stage times of every W
        summed, ``per_world`` the W checked."""
        seconds: dict[str, float] = {}
        for one in self.each:  # every W's, not the last W's alone
            for stage, took in one.seconds.items():
                seconds[stage] = seconds.get(stage, 0.0) + took
        one = self.each[-1]
        one.seconds = seconds
        one.per_world = self.worlds
        one.per_world_line = getattr(self.loop, "line", 0)
        one.options = options
        return one


def _per_world(c: Compilation, loop: Any, until: str) -> Compilation:
    """The stages of a file whose unrolled steps name W: the per-W stage, then (to
    ``emit``) one module of every W's class."""
    found = _each_world(c, loop, until)
    one = found.merged(c.options)
    if until == "emit":
        start = time.perf_counter()
        one.module_text = _emit_worlds(found, one)
        one.seconds["emit"] = time.perf_counter() - start
    return one


def _each_world(c: Compilation, loop: Any, until: str) -> Worlds:
    """The per-W stage: each W its own unrolled schedule, through the stages up to
    ``until`` (``hb`` at most); the bounds over every W together come first."""
    from dataclasses import replace

    from dcpc.diagnostics import Mark
    from dcpc.lang.loops import MAX_TOTAL_STEPS, first_too_long, widest_within_budget
    from dcpc.lang.mesh import worlds_text

    worlds = list(c.options.worlds)
    if c.options.worlds is DEFAULT_WORLDS and c.source is not None:
        worlds = _raw_defaults(c.source[0])  # a mesh's default shapes, as for any file
    last = STAGE_NAMES.index("hb") if until == "emit" else STAGE_NAMES.index(until)
    # a W whose unrolling passes the step bound is refused before any W is analysed
    # (its parse raises loop-too-long); the trip counts alone say which W that is
    too_long = first_too_long(c.source[0], worlds) if c.source is not None else None
    if too_long is not None:
        run(c.path, replace(c.options, worlds=[too_long]), until="parse", source=c.source)
    total, widest = widest_within_budget(c.source[0], worlds) if c.source else (0, None)
    if total > MAX_TOTAL_STEPS:
        narrower = (f"check W {worlds_text([w for w in worlds if w <= widest])} (or a few "
                    "W at a time)" if widest else "check fewer W at a time")
        raise DiagnosticError([Diagnostic(
            Mark(str(c.path), loop.line, loop.col), "schedule-too-large",
            f"the unrolled steps depend on W ({NAMES_W}), "
            f"so each W is unrolled and analysed on its own: "
            f"W {worlds_text(worlds)} make {total} unrolled steps in all, past the "
            f"{MAX_TOTAL_STEPS} one check analyses; {narrower}")])
    # every W is parsed and structurally checked first (cheap); the happens-before work
    # of all of them together is then bounded before any W is analysed
    cheap = min(last, STAGE_NAMES.index("check"))
    quiet = replace(c.options, strict=False)  # --strict judges the warnings of every W
    done: list[Compilation] = []
    failed: list[DiagnosticError] = []
    for w in worlds:  # every W, so that an error names each W it holds at
        try:
            done.append(run(c.path, replace(quiet, worlds=[w]), until=STAGE_NAMES[cheap],
                            source=c.source))
        except DiagnosticError as err:
            failed.append(err)
    if failed:
        raise _per_world_errors(failed)
    warnings = _per_world_warnings(done, worlds)
    for one in done:  # a later stage's error lists these, as a single W's lists its own
        one.warnings = warnings
    if c.options.strict and warnings and cheap == STAGE_NAMES.index("check"):
        err = DiagnosticError(warnings)
        err.compilation = done[-1]  # type: ignore[attr-defined]
        raise err
    if last > cheap:
        if c.options.hb:
            _per_world_budget(c, loop, done)
        for one in done:
            _stages(one, STAGE_NAMES[cheap + 1], STAGE_NAMES[last])
    return Worlds(loop, worlds, done)


def _emit_worlds(found: Worlds, one: Compilation) -> str:
    """One module for every W checked of a file whose loops name W (not a mesh axis'
    size), each W's class in it (dcpc.codegen.emit.emit_worlds); when a W's loops name
    an axis size (a module is then per shape), a ``loop-world`` error."""
    from dcpc.codegen.emit import emit_worlds

    by_world: dict[int, Compilation] = {}
    for each in found.each:
        served = each.schedule.loop_world if each.schedule is not None else None
        if not isinstance(served, int) or each.plan is None:
            raise _one_world_only(found, one)
        # the shapes of one W share its unrolling: one class serves them (as --world 2x3)
        by_world.setdefault(served, each)
    return emit_worlds([each.plan for each in by_world.values()],  # type: ignore[misc]
                       [w for each in found.each for w in each.worlds])


def _one_world_only(found: Worlds, one: Compilation) -> DiagnosticError:
    """The ``loop-world`` error of a per-W file compiled for several W whose W cannot
    each give a class of one module (its loops name a mesh axis' size): a module is
    then unrolled for one W or shape."""
    from dcpc.diagnostics import Mark

    worlds, mark = found.worlds, found.loop
    per_shape = isinstance(one.schedule.loop_world, tuple)  # it names an axis size
    err = DiagnosticError([Diagnostic(
        Mark(str(one.path), mark.line, mark.col), "loop-world",
        f"the unrolled steps name a mesh axis' size (a trip count, an index, an offset "
        f"or an interleave), so its module is unrolled for one mesh shape; checked "
        f"W={', '.join(map(str, worlds))}, but a module needs one --world shape such "
        f"as {worlds[0]}" if per_shape else
        f"the unrolled steps name W (a trip count, an index or an offset), so its "
        f"module is unrolled for one W; "
        f"checked W={', '.join(map(str, worlds))}, but a module needs one --world N")])
    err.compilation = one  # type: ignore[attr-defined]
    return err
