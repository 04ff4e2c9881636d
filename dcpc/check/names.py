"""Names: identifiers, duplicates, references to buffers that are not declared."""

from __future__ import annotations

import keyword
import pkgutil
import re
import site
import sys
import sysconfig
from collections.abc import Callable
from functools import cache

from dcpc.check.context import Context, all_refs
from dcpc.codegen.lower import (
    AMBIGUOUS,
    base_class_names,
    class_name,
    method_names,
    module_imports,
)
from dcpc.diagnostics import NOWHERE, Mark, did_you_mean
from dcpc.lang import expr as ex
from dcpc.lang.model import Buffer, Schedule, Step
from dcpc.lang.questions import Counterexample
from dcpc.lang.sizes import WORLD
from dcpc.ops.external import External
from dcpc.ops.iface import Counts, RowIndex
from dcpc.ops.registry import count_capacities, input_rules, placed, writer
from dcpc.ops.sync import Signal, Wait

LOWER_IDENT = re.compile(r"[a-z_][a-z0-9_]*\Z")
# Schedule, buffer and step names become Python names of the generated module; every
# name that module introduces itself starts with '_', so these may not.
NAME_IDENT = re.compile(r"[a-z][a-z0-9_]*\Z")
SIZE_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SLICE = re.compile(r"(.+)_([0-9]+)")  # slice i of an indexed buffer b: 'b_<i>'
# Every name: the generated module's lines (at most 100 characters) and its file name
# '<schedule>.py' must fit.
MAX_NAME = 48
PATTERNS = {
    "schedule name": NAME_IDENT, "buffer name": NAME_IDENT, "step name": NAME_IDENT,
    "size name": SIZE_IDENT,
}

# The emitted module is <schedule>.py, imported with its folder on sys.path: it must not
# shadow a module it, Python or an engine imports. Python imports these at start-up
# from any folder on the path; the rest are what engines load beside dcpc, installed
# here or not (the environment that imports the module may have more than this one).
STARTUP_MODULES = frozenset({"sitecustomize", "usercustomize"})
ENGINE_MODULES = frozenset({
    "dcpc", "flashinfer", "jinja2", "networkx", "numpy", "pkg_resources", "pydantic",
    "safetensors", "setuptools", "sglang", "sympy", "tokenizers", "torch", "transformers",
    "triton", "typing_extensions", "vllm", "yaml",
})


@cache
def importable_modules() -> frozenset[str]:
    """Top-level module names a schedule may not take: the standard library, Python's
    start-up hooks, what the emitted module imports, the engines' usual packages, and
    every module installed in this environment's site-packages."""
    folders = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    folders |= set(getattr(site, "getsitepackages", list)())
    installed = {m.name for m in pkgutil.iter_modules(sorted(folders))}
    return (module_imports() | STARTUP_MODULES | ENGINE_MODULES | frozenset(installed)
            | frozenset(sys.builtin_module_names)
            | frozenset(getattr(sys, "stdlib_module_names", ())))


def _identifier_problem(name: str, pattern: re.Pattern[str]) -> str | None:
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters long; names have at most {MAX_NAME}"
    if not pattern.match(name):
        rule = pattern.pattern.removesuffix("\\Z")
        if pattern is NAME_IDENT and name[:1] == "_":
            return f"must match {rule}: names starting with '_' belong to the generated code"
        return f"must match {rule}"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return "is a Python keyword"
    if name.startswith("__"):
        return "must not start with '__' (Python reserves those names)"
    return None


def _suggest(name: str) -> str:
    fixed = re.sub(r"[^a-z0-9_]", "_", name.lower()).lstrip("_")[:MAX_NAME - 5] or "name"
    if fixed[0].isdigit():
        fixed = "n" + fixed
    if keyword.iskeyword(fixed) or keyword.issoftkeyword(fixed):
        fixed = fixed + "_step"
    return f"rename it, e.g. to '{fixed}'"


def _check_name(ctx: Context, name: str, what: str, mark: Mark) -> None:
    problem = _identifier_problem(name, PATTERNS.get(what, LOWER_IDENT))
    if problem:
        shown = name if len(name) <= MAX_NAME else name[:20] + "..."
        ctx.error(mark, "bad-identifier", f"{what} {shown!r} {problem}", hint=_suggest(name))
        return
    if what in ("buffer name", "step name") and name in AMBIGUOUS:
        ctx.error(mark, "reserved-name",
                  f"{what} '{name}' reads as 1 or 0 (pycodestyle E741: the generated module "
                  "would fail the project's lint)", hint=f"rename it, e.g. to '{name}_buf'"
                  if what == "buffer name" else f"rename it, e.g. to '{name}_step'")
    elif what == "size name" and name == "W":
        ctx.error(mark, "reserved-name", "size 'W' is predefined (the group size)",
                  hint="remove it from sizes; every schedule can use W")
    elif what == "step name" and name in base_class_names():
        ctx.error(mark, "reserved-name",
                  f"step name '{name}' collides with a name the generated class inherits "
                  "from dcpc.runtime.ScheduleModule",
                  hint=f"rename it, e.g. to '{name}_step' (taken: "
                  f"{', '.join(sorted(n for n in base_class_names() if n.islower()))})")
    elif what == "buffer name" and name in method_names():
        ctx.error(mark, "reserved-name",
                  f"buffer name '{name}' collides with a parameter of the generated methods",
                  hint=f"rename it, e.g. to '{name}_buf' (taken: "
                  f"{', '.join(sorted(method_names()))})")
    elif what == "schedule name" and name in importable_modules():
        ctx.error(mark, "reserved-name",
                  f"schedule name '{name}' would make a module '{name}.py' that shadows "
                  f"the importable module '{name}' (the output folder goes on PYTHONPATH)",
                  hint=f"rename it, e.g. to '{name}_dcp'")
    elif what == "schedule name" and (
        keyword.iskeyword(class_name(name)) or class_name(name) in AMBIGUOUS
    ):
        ctx.error(mark, "reserved-name",
                  f"schedule name '{name}' would make a class '{class_name(name)}', "
                  + ("a Python keyword" if keyword.iskeyword(class_name(name)) else
                     "a name that reads as 1 or 0 (pycodestyle E742)"),
                  hint=f"rename it, e.g. to '{name}_dcp'")


def check_names(ctx: Context) -> None:
    """Identifiers, the one-key rule of step items, duplicates and name clashes."""
    schedule = ctx.schedule
    _check_name(ctx, schedule.schedule, "schedule name", schedule.mark("schedule"))
    for name in schedule.sizes:
        _check_name(ctx, name, "size name", schedule.mark(f"sizes/{name}", of_key=True))
    for name in schedule.buffers:
        _check_name(ctx, name, "buffer name", schedule.mark(f"buffers/{name}", of_key=True))

    for i, item in enumerate(schedule.steps):
        if not item:
            ctx.error(schedule.mark(f"steps[{i}]"), "bad-step",
                      f"step item {i + 1} is empty; a step is a one-key mapping "
                      "'name: {op: ...}'")
        for extra in list(item.values())[1:]:
            ctx.error(extra.mark("__name__"), "bad-step",
                      f"step item {i + 1} holds more than one step; write each step as "
                      "its own list item",
                      hint="start the line with '- '")

    first: dict[str, Mark] = {}
    for step in ctx.steps:
        mark = step.mark()
        _check_name(ctx, step.name, "step name", mark)
        if step.name in first:
            ctx.error(mark, "duplicate-step", f"step name '{step.name}' is used twice",
                      hint=f"the first '{step.name}' is at line {first[step.name].line}; "
                      "rename one of them")
        else:
            first[step.name] = mark
        if step.name in schedule.buffers:
            ctx.error(mark, "name-clash",
                      f"step '{step.name}' has the name of a buffer; the generated method "
                      "and its argument would collide",
                      hint=f"rename the step, e.g. to '{step.name}_step'")
        if isinstance(step.op, (Signal, Wait)):
            _check_name(ctx, step.op.channel, "channel name", step.op.mark("channel"))


def check_references(ctx: Context) -> None:
    """Every buffer a step names is declared; warn about buffers nothing uses."""
    buffers = ctx.schedule.buffers
    used: set[str] = set()
    for step in ctx.steps:
        for ref in all_refs(step.op):
            used.add(ref.name)
            if ref.name not in buffers:
                ctx.error(ref.mark, "unknown-buffer",
                          f"step '{step.name}' names buffer '{ref.name}' ({ref.role}), "
                          "which is not declared under buffers",
                          hint=did_you_mean(ref.name, buffers)
                          or f"declare '{ref.name}' under buffers")
    # the slices of an indexed buffer (dcpc.lang.loops: b_0 .. b_{P-1}, each with the
    # declaration's mark) are one declared buffer: used when one slice is; a slice that
    # a W leaves unused (ring_attention's second receive buffer at W=2) is no mistake
    declared: dict[tuple[Mark, str], list[str]] = {}
    for name in buffers:
        mark = ctx.schedule.mark(f"buffers/{name}", of_key=True)
        sliced = _SLICE.fullmatch(name)
        key = (mark, sliced.group(1)) if sliced and mark != NOWHERE else (mark, name)
        declared.setdefault(key, []).append(name)
    for (mark, base), names in declared.items():
        if used.isdisjoint(names):
            what = (f"buffer '{base}' (its slices {names[0]} .. {names[-1]})"
                    if len(names) > 1 else f"buffer '{names[0]}'")
            ctx.error(mark, "unused-buffer", f"{what} is not used by any step",
                      severity="warning", hint="remove it, or name it in a step")


def check_buffers(ctx: Context) -> None:
    """Per-buffer rules: flags that contradict each other, LSE buffers' dtypes."""
    # the slot capacity of each placement index (registry.placed: one pass over the
    # steps), asked once for every buffer, only where a buffer declares 'values'
    valued = any(b.values is not None for b in ctx.schedule.buffers.values())
    slots = placed(ctx.schedule) if valued else {}
    for name, buffer in ctx.schedule.buffers.items():
        _check_buffer(ctx, name, buffer, slots)
    _check_slots(ctx, ctx.schedule)


def _check_buffer(ctx: Context, name: str, buffer: Buffer, slots: dict[str, str]) -> None:
    if buffer.shared and "symmetric" in buffer.src_marks and not buffer.symmetric:
        ctx.error(buffer.mark("symmetric"), "shared-not-symmetric",
                  f"buffer '{name}' is shared (symmetric, one instance for all slots) "
                  "but says 'symmetric: false'",
                  hint="drop 'symmetric: false' (shared implies symmetric)")
    _check_values(ctx, name, buffer, slots)
    if buffer.persist:
        _check_persist(ctx, name, buffer)
    if buffer.lse_base is not None:
        if not buffer.dtype.is_float:
            ctx.error(buffer.mark("lse_base"), "lse-base-not-float",
                      f"buffer '{name}' has lse_base but dtype {buffer.dtype.value}; "
                      "an LSE is a float tensor",
                      hint="use dtype f32 (or f16/bf16), or drop lse_base")
        elif buffer.dtype.value not in ("f32", "f16", "bf16"):
            ctx.error(buffer.mark("dtype"), "bad-lse-dtype",
                      f"LSE buffer '{name}' has dtype {buffer.dtype.value}; "
                      "an LSE must be f32, f16 or bf16",
                      hint="use dtype f32")


def _check_persist(ctx: Context, name: str, buffer: Buffer) -> None:
    """A persistent buffer is the module's (symmetric, or local and written by a method)
    and has one shape for every call (no size bound per call)."""
    if not buffer.is_symmetric and name not in ctx.schedule.method_outputs():
        ctx.error(buffer.mark("persist"), "persist-engine-owned",
                  f"buffer '{name}' persists across calls, but it is the engine's (not "
                  "symmetric, and no method writes it): the engine passes it in every "
                  "call, so what it holds from call to call is the engine's to keep",
                  hint="drop 'persist: true' (the engine keeps its tensor), or add "
                  "'symmetric: true' so the module owns it")
    per_call = {n for n, spec in ctx.schedule.sizes.items()
                if not isinstance(spec, int) and spec.max is not None}
    for dim in buffer.shape:
        try:
            named = sorted(ex.symbols(ex.parse(dim)) & per_call)
        except ValueError:
            continue  # a bad expression: the shape check reports it
        if named:
            ctx.error(buffer.mark("persist"), "persist-size",
                      f"buffer '{name}' persists across calls, but its shape names "
                      f"{', '.join(named)}, a size bound per call ({{max: ...}}): one "
                      "call's contents would not have the next call's shape",
                      hint="size it by constants, W or sizes bound at construction "
                      "(multiple_of)")
            return


def _check_values(ctx: Context, name: str, buffer: Buffer, slots: dict[str, str]) -> None:
    """``values: {min, max}``: an integer buffer's, within its dtype and 0.., never empty,
    with a value a count's capacity admits, for every admissible binding (its ends parse
    in ``size_table``); never on a buffer an op reads as row numbers (``RowIndex``: which
    rows exist is the op's rule, dcpc.ops.iface). ``slots``: ``placed``'s table."""
    if buffer.values is None:
        return
    if buffer.dtype.is_float:
        ctx.error(buffer.mark("values"), "bad-values",
                  f"buffer '{name}' is {buffer.dtype.value}, but 'values' bounds the values "
                  "of an integer buffer (i32, i64: expert ids, counts)",
                  hint="drop 'values', or declare the buffer i32 or i64")
        return
    reads = _value_rules(ctx.schedule, name)
    index = next((step for step, rule in reads if isinstance(rule, RowIndex)), None)
    if index is not None:
        ctx.error(buffer.mark("values", of_key=True), "bad-values",
                  f"buffer '{name}' is read as row numbers by step '{index.name}' "
                  f"({index.op.op}): an index takes the rows that exist (or -1, an empty "
                  "slot), not a declared range", hint="drop 'values' (the op bounds an index)")
        return
    tight = None  # the ends' values nearest each other (an end named by a buffer)
    bounds = ctx.table.values.get(name)
    if bounds is None and name in ctx.table.value_ends:
        found = _bound_buffers(ctx, name, buffer, slots)
        if found is None:
            return  # reported
        bounds, tight = found
    if bounds is None:
        return  # an end that does not parse or names an unknown size: reported
    low, high = bounds
    own = ctx.table.value_ends.get(name, bounds)  # an end a buffer names: its own checks
    for node, end in ((low, "min"), (high, "max")):
        if own[end == "max"] is None:
            continue
        where = ctx.samples.inexact(node)
        if ctx.undecided(buffer.values.mark(end), f"'values: {end}' of buffer '{name}' "
                         f"({ex.unparse(node)})", where):
            return
        if where is not None:
            ctx.error(buffer.values.mark(end), "inexact-division",
                      f"'values: {end}' of buffer '{name}' ({ex.unparse(node)}) is not a whole "
                      f"number at W={where.world}{_also(where, node)}: {where.detail}",
                      hint="divide only by what divides it for every W checked")
            return
    written = next((step for step in ctx.schedule.step_list()
                    if isinstance(step.op, External) and any(
                        index == name and target in step.op.writes
                        for target, index in step.op.rows.items())), None)
    if written is not None and not buffer.values.distinct:
        ctx.error(buffer.mark("values"), "bad-values",
                  f"buffer '{name}' names the rows step '{written.name}' writes (rows by "
                  "values), but its 'values' may repeat a row: a write of one row twice "
                  "keeps either value, not a deterministic result",
                  hint="declare its values distinct: 'values: {min: ..., max: ..., "
                  "distinct: true}' (dcpc run draws them so; the engine must write them so)")
        return
    reported: set[str] = set()  # one error per end (several counts' capacities: the first)
    asks = _range_asks(ctx, name, buffer, bounds, reads, slots.get(name), tight)
    asks += _rows_asks(ctx, name, buffer, bounds)
    for positive, says, hint, end in asks:
        if end in reported:
            continue
        at = ctx.samples.nonpositive(positive)
        if ctx.undecided(buffer.values.mark(end), f"'values' of buffer '{name}'", at):
            pass
        elif at is not None:
            ctx.error(buffer.values.mark(end), "bad-values", says(at), hint=hint)
        if at is not None:
            reported.add(end)


_Ask = tuple[ex.Expr, Callable[[Counterexample], str], str, str]
_Bounds = tuple[ex.Expr, ex.Expr]


def _bound_buffers(ctx: Context, name: str, buffer: Buffer, slots: dict[str, str]
                   ) -> tuple[_Bounds, _Bounds] | None:
    """A ``values`` whose ends name buffers (``max: n_send``, ``ValueRange.buffers``):
    each an integer buffer other than ``name``, no wider, its shape the first dims of
    ``name``'s (read elementwise, broadcast over the rest), its own range size
    expressions (declared, or row counts an op reads: 0 .. capacity; so no chain and no
    cycle), and both buffers what the engine passes, drawn together at a call's start
    (no step writes them, neither is the module's memory); not on a buffer drawn as
    distinct rows. The ends (widest, nearest each other) with a named end replaced by
    the named buffer's range, or None (reported, or an end reported by ``size_table``)."""
    assert buffer.values is not None
    named = buffer.values.buffers(ctx.schedule.buffers)
    own = ctx.table.value_ends[name]
    if any(own[i] is None and end not in named for i, end in enumerate(("min", "max"))):
        return None  # a size-expression end that does not parse: reported
    ranges: dict[str, _Bounds] = {}
    for end, other in named.items():
        mark = buffer.values.mark(end)
        theirs = ctx.schedule.buffers[other]
        said = f"'values: {end}' of buffer '{name}' names buffer '{other}'"
        size = _a_size(ctx)
        fix = f"bound it by a size expression ('{end}: {size}') or by another integer buffer"
        problem, hint = _bound_problem(ctx, name, buffer, other, theirs, slots)
        if problem is None:
            found = ctx.table.values.get(other)
            caps = [] if found is not None or other in ctx.table.value_ends \
                else list(dict.fromkeys(count_capacities(ctx.schedule).get(other, [])))
            if len(caps) == 1:
                try:
                    found = (("num", 0), ex.parse(caps[0]))
                except ex.ExprSyntaxError:
                    return None  # the step's capacity: reported with the step
            if found is not None:
                ranges[end] = found
            elif caps:  # dcpc run draws within the least: no one expression the checker reads
                problem = ("which steps read as row counts of capacities "
                           f"{' and '.join(caps)}: it declares no 'values' to say which "
                           "range it holds")
                hint = (f"declare '{other}' 'values: {{min: 0, max: {caps[0]}}}', or "
                        f"{fix[0].lower()}{fix[1:]}")
            else:
                problem = ("whose own values are not bounded by size expressions ("
                           + ("its 'values' names a buffer: a bound reads a buffer drawn by "
                              "sizes, no chain or cycle)" if other in ctx.table.value_ends
                              else "it declares no 'values' and no op reads it as counts)"))
                hint = (f"declare '{other}' 'values: {{min: 0, max: {size}}}' with size "
                        f"expressions, or {fix[0].lower()}{fix[1:]}")
        if problem is not None:
            ctx.error(mark, "bad-values", f"{said}, {problem}", hint=hint or fix)
            return None
    low, high = own
    wide = (ranges["min"][0] if "min" in ranges else low,
            ranges["max"][1] if "max" in ranges else high)
    tight = (ranges["min"][1] if "min" in ranges else low,
             ranges["max"][0] if "max" in ranges else high)
    assert None not in wide and None not in tight
    return wide, tight  # type: ignore[return-value]


def _a_size(ctx: Context) -> str:
    """A size the file declares, for a hint's example ('max: C'): the first declared
    that is well formed, else W."""
    return next((name for name, size in ctx.table.sizes.items()
                 if name != WORLD and not size.broken), WORLD)


def _bound_problem(ctx: Context, name: str, buffer: Buffer, other: str, theirs: Buffer,
                   slots: dict[str, str]) -> tuple[str | None, str | None]:
    """What keeps buffer ``other`` from bounding ``name``'s values elementwise (the
    message's tail and a hint, or None, None): see ``_bound_buffers``."""
    fix = f"bound it by a size expression, e.g. 'max: {_a_size(ctx)}'"
    if other in ctx.table.sizes:
        return (f"and size '{other}' too: a bound names one or the other, never both "
                "(ambiguous)"), f"rename size '{other}' or buffer '{other}'"
    if other == name:
        return "itself", fix
    if theirs.dtype.is_float:
        return f"a {theirs.dtype.value} buffer: a bound is an integer", \
            "name an integer buffer (i32, i64), or " + fix[0].lower() + fix[1:]
    if theirs.dtype.itemsize > buffer.dtype.itemsize:
        return (f"an {theirs.dtype.value} buffer, wider than its {buffer.dtype.value}"), \
            f"declare '{name}' {theirs.dtype.value}, or " + fix[0].lower() + fix[1:]
    mine, shape = ctx.table.shapes.get(name), ctx.table.shapes.get(other)
    if mine is not None and shape is not None and mine[:len(shape)] != shape:
        dims = buffer.shape[:len(shape)] if len(shape) <= len(mine) else buffer.shape
        return (f"of shape [{', '.join(map(str, theirs.shape))}], not the first dims of its "
                f"[{', '.join(map(str, buffer.shape))}] (a bound is read elementwise, "
                "broadcast over the last dims)"), \
            f"name a buffer of shape [{', '.join(map(str, dims))}], or " + fix[0].lower() \
            + fix[1:]
    if buffer.values is not None and (buffer.values.distinct or name in slots):
        return ("but it is drawn as distinct rows (an index): a bound read elementwise "
                "bounds counts and ids"), fix
    for who, spec in ((name, buffer), (other, theirs)):
        if spec.is_symmetric or spec.persist:
            return (f"but '{who}' is the module's memory: a drawn bound reads a buffer the "
                    "engine passes, drawn with it at the call's start"), fix
        step = writer(ctx.schedule, who)
        if step is not None:
            return (f"but step '{step.name}' ({step.op.op}) writes '{who}': a drawn bound "
                    "reads a buffer the engine passes, drawn with it at the call's start, "
                    "never one a step writes"), fix
    return None, None


def _range_asks(ctx: Context, name: str, buffer: Buffer, bounds: tuple[ex.Expr, ex.Expr],
                reads: list[tuple[Step, object]], slot: str | None,
                tight: tuple[ex.Expr, ex.Expr] | None = None) -> list[_Ask]:
    """What must stay positive for every binding, what is wrong where it does not, the
    hint, the end to point at: not empty, max within the dtype, min not below 0 (-1 is
    the poison), min within the capacity of every count the buffer is read as, and below
    ``slot``, the capacity of the slot a placement index (``placed``) names rows of.
    ``tight``: where an end names a buffer (``_bound_buffers``), the ends nearest each
    other (not empty, min within a capacity: for every element); ``bounds`` the widest."""
    low, high = tight or bounds
    asks: list[_Ask] = [
        (("+", ("-", high, low), ("num", 1)),
         lambda at: f"'values' of buffer '{name}' is empty at W={at.world}"
         f"{_also(at, low, high)}: min {ex.unparse(low)} = {ex.evaluate(low, at.binding)} "
         f"is above max {ex.unparse(high)} = {ex.evaluate(high, at.binding)}"
         + (" (an end a buffer names: the nearest value it holds)" if tight else ""),
         "both ends are included: 'values: {min: 0, max: E - 1}' is 0 .. E-1", "max")]
    asks += _wide_asks(ctx, name, buffer, bounds, reads, slot, low)
    return asks


def _wide_asks(ctx: Context, name: str, buffer: Buffer, bounds: tuple[ex.Expr, ex.Expr],
               reads: list[tuple[Step, object]], slot: str | None,
               least: ex.Expr) -> list[_Ask]:
    """``_range_asks`` but the emptiness: ``least`` is the largest value min takes."""
    low, high = bounds
    top = 2 ** (8 * buffer.dtype.itemsize - 1) - 1
    asks: list[_Ask] = [
        (("-", ("num", top + 1), high),
         lambda at: f"'values: max' of buffer '{name}' ({ex.unparse(high)}) is "
         f"{ex.evaluate(high, at.binding)} at W={at.world}{_also(at, high)}, above the "
         f"largest {buffer.dtype.value} {top}",
         "declare the buffer i64, or lower the bound", "max"),
        (("+", low, ("num", 1)),
         lambda at: f"'values: min' of buffer '{name}' ({ex.unparse(low)}) is "
         f"{ex.evaluate(low, at.binding)} at W={at.world}{_also(at, low)}, below 0 (-1 is "
         "the poison value: no buffer holds it)", "keep the range in 0 .., e.g. 'min: 0'",
         "min")]
    known = {*ctx.table.sizes, WORLD}
    for step, rule in reads:
        if not isinstance(rule, Counts):
            continue
        try:
            cap = ex.parse(rule.capacity)
        except ex.ExprSyntaxError:
            continue  # the step's capacity: reported with the step
        if ex.symbols(cap) <= known:
            asks.append((
                ("+", ("-", cap, least), ("num", 1)),
                lambda at, step=step, cap=cap: f"'values: min' of buffer '{name}' "
                f"({ex.unparse(least)}) is {ex.evaluate(least, at.binding)} at W={at.world}"
                f"{_also(at, least, cap)}, above the capacity {ex.unparse(cap)} = "
                f"{ex.evaluate(cap, at.binding)} of the row counts step '{step.name}' "
                f"({step.op.op}) reads it as: no count is both",
                "a count is 0 .. its capacity: lower 'min'", "min"))
    try:
        cap = ex.parse(slot) if slot is not None else None
    except ex.ExprSyntaxError:
        cap = None  # the step's capacity: reported with the step
    if cap is not None and ex.symbols(cap) <= known:
        asks.append((
            ("-", cap, least),
            lambda at: f"'values: min' of buffer '{name}' ({ex.unparse(least)}) is "
            f"{ex.evaluate(least, at.binding)} at W={at.world}{_also(at, least, cap)}, not "
            f"below the capacity {ex.unparse(cap)} = {ex.evaluate(cap, at.binding)} of the "
            "slot whose rows it names (a ragged move's index, or what lands in one): no "
            "row is both",
            "an index is a row of its slot, 0 .. capacity - 1: lower 'min'", "min"))
    return asks


def _rows_asks(ctx: Context, name: str, buffer: Buffer,
               bounds: tuple[ex.Expr, ex.Expr]) -> list[_Ask]:
    """An index of rows by values (``b[idx]``, an external step's ``rows``): max below
    the rows of axis 0 of every buffer (slot) it indexes, and, declared distinct, a range
    that holds a value for each of its elements."""
    low, high = bounds
    asks: list[_Ask] = []
    known = {*ctx.table.sizes, WORLD}
    seen: set[str] = set()
    for step in ctx.schedule.step_list():
        if not isinstance(step.op, External):
            continue
        for target, index in step.op.rows.items():
            if index != name or target in seen or target not in ctx.schedule.buffers:
                continue
            seen.add(target)
            try:
                rows = ex.parse(ctx.schedule.buffers[target].shape[0])
            except (ex.ExprSyntaxError, ValueError):
                continue  # the shape check reports it
            if not ex.symbols(rows) <= known:
                continue
            asks.append((
                ("-", rows, high),
                lambda at, step=step, target=target, rows=rows: f"'values: max' of buffer "
                f"'{name}' ({ex.unparse(high)}) is {ex.evaluate(high, at.binding)} at "
                f"W={at.world}{_also(at, high, rows)}, not below the {ex.unparse(rows)} = "
                f"{ex.evaluate(rows, at.binding)} rows of '{target}' whose rows step "
                f"'{step.name}' takes by its values: a row that does not exist",
                f"an index of rows is 0 .. rows - 1: 'max: {ex.unparse(rows)} - 1'", "max"))
    if buffer.values is not None and buffer.values.distinct:
        try:  # its elements: the product of its dims
            count = ex.parse(buffer.shape[0])
            for dim in buffer.shape[1:]:
                count = ("*", count, ex.parse(dim))
        except (ex.ExprSyntaxError, ValueError):
            count = None
        if count is not None and ex.symbols(count) <= known:
            asks.append((
                ("-", ("+", ("-", high, low), ("num", 2)), count),
                lambda at, count=count: f"'values' of buffer '{name}' "
                f"({ex.unparse(low)} .. {ex.unparse(high)}) holds "
                f"{max(ex.evaluate(high, at.binding) - ex.evaluate(low, at.binding) + 1, 0)} "
                f"value(s) at W={at.world}{_also(at, low, high, count)}, fewer than its "
                f"{ex.unparse(count)} = {ex.evaluate(count, at.binding)} elements, which "
                "'distinct: true' keeps apart", "widen the range to hold a value per element",
                "max"))
    return asks


def _value_rules(schedule: Schedule, name: str) -> list[tuple[Step, object]]:
    """(step, rule): what each step's op declares about the values of ``name`` that it
    reads (``OpDef.inputs``, dcpc.ops.iface), in step order."""
    return [(step, rules[name]) for step, rules
            in zip(schedule.step_list(), input_rules(schedule), strict=True) if name in rules]


def _also(where: Counterexample, *nodes: ex.Expr) -> str:
    """``", C=4, L=2"``: the other sizes of a counterexample that ``nodes`` use."""
    named = where.names(nodes)
    return f", {named}" if named else ""


def _check_slots(ctx: Context, schedule: Schedule) -> None:
    if schedule.slots == 1 and "streams" in schedule.src_marks:
        ctx.error(schedule.mark("streams"), "slots-streams",
                  "'streams' orders the slots of a schedule, but it has only one slot",
                  hint="drop 'streams', or add 'slots: 2' for overlapped microbatches",
                  severity="warning")
    if schedule.slots == 1:
        for name, buffer in schedule.buffers.items():
            if (buffer.shared and "shared" in buffer.src_marks  # not one persist made
                    and schedule.module_view_of(name) is None):  # a chunk: its slot's
                ctx.error(buffer.mark("shared"), "slots-streams",
                          f"buffer '{name}' is shared between slots, but the schedule "
                          "has only one slot", severity="warning",
                          hint="use 'symmetric: true' instead of 'shared: true'")
