"""Size binding: which values the size symbols of a schedule can take for a W.

``W`` (the group size) is predefined. A size is a constant (``D: 576``), bound per
call up to a maximum (``T: {max: 512}``), or bound at construction to a multiple of
an expression of W (``H: {multiple_of: W}``); ``max`` and ``multiple_of`` may be
given together. Shapes are parsed into ``dcpc.lang.expr`` ASTs, never ``eval``ed.

The checker decides symbolic questions (are two shapes equal? does a division always
come out whole? can a dimension be zero?) exactly over every admissible binding of
every W asked (``dcpc.lang.exact``), or refuses what it cannot decide. A failed
question comes back as a concrete counterexample binding, which the diagnostics
print. ``sample_bindings`` (a handful of values per symbol, edge values included)
remains for witness searches and the tests.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from dcpc.diagnostics import Diagnostic, Mark, clipped, did_you_mean
from dcpc.lang import expr as ex
from dcpc.lang.mesh import mesh_of, shape_of
from dcpc.lang.model import Schedule, SizeSpec
from dcpc.ops.registry import writer

Binding = dict[str, int]

WORLD = "W"
SAMPLES_PER_WORLD = 48
# The language's limits (docs/language.md, "Limits"): every size and every dimension
# fits a signed 32-bit integer, and one instance of a buffer (one rank, one slot) is
# at most 1 TiB at the largest binding of its sizes.
MAX_SIZE = 2**31 - 1
MAX_BUFFER_BYTES = 2**40


@dataclass(frozen=True)
class Size:
    """One size symbol as declared: a constant, a per-call maximum, a multiple, or W."""

    name: str
    constant: int | None = None
    max: int | None = None
    multiple_of: ex.Expr | None = None  # None when absent or unparsable
    broken: bool = False  # its declaration is wrong (reported once): nothing is sampled
    axis: int | None = None  # sizes mesh axis ``axis`` (dcpc.lang.mesh): bound by the shape

    @property
    def is_runtime(self) -> bool:
        """Bound per call (``max`` only): the codegen binds it from argument shapes."""
        return (self.max is not None and self.multiple_of is None and self.constant is None
                and self.axis is None)


@dataclass
class SizeTable:
    """The sizes of a schedule, its parsed shapes, and what was wrong with them.

    ``shapes[name]`` is None for a buffer whose shape could not be parsed or names
    an unknown size; checks that need that shape skip it (its error is reported once).
    """

    sizes: dict[str, Size] = field(default_factory=dict)
    shapes: dict[str, list[ex.Expr] | None] = field(default_factory=dict)
    # an integer buffer's ``values: {min, max}``, parsed; absent when not declared or broken
    values: dict[str, tuple[ex.Expr, ex.Expr]] = field(default_factory=dict)
    # of a ``values`` with an end that names a buffer (``max: n_send``): its ends that
    # are size expressions, parsed (None: the buffer's end, or one broken and reported)
    value_ends: dict[str, tuple[ex.Expr | None, ex.Expr | None]] = field(
        default_factory=dict)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    mesh_constants: list[int] = field(default_factory=list)  # axes sized by an integer


# one definition of an expression's limits and of its bounded parse (dcpc.lang.expr)
parse_expr = ex.parse


def _syntax_diag(mark: Mark, text: str | int, err: ex.ExprSyntaxError, what: str) -> Diagnostic:
    col = mark.col + err.column if isinstance(text, str) and mark.line else mark.col
    return Diagnostic(
        Mark(mark.file, mark.line, col), "shape-syntax",
        f"{what} {clipped(repr(text))} is not a size expression: {err}",
        hint="use integers, size names, + - * / and parentheses, e.g. 'H/W'",
    )


def size_table(schedule: Schedule) -> SizeTable:
    """Parse the sizes and every buffer shape of a schedule.

    Reports ``shape-syntax`` (an expression that does not parse) and ``unknown-size``
    (a shape naming a size that is not declared). ``multiple_of`` expressions are
    parsed here; their meaning is checked by :func:`world_diagnostics`.
    """
    table = SizeTable()
    table.sizes[WORLD] = Size(WORLD)
    axes = mesh_of(schedule).size_names() if schedule.mesh else {}
    if schedule.mesh:
        table.mesh_constants = [v for v in schedule.mesh.values() if isinstance(v, int)]
    for name, axis in axes.items():
        spec = schedule.sizes.get(name)
        if name == WORLD or not name.isidentifier():
            continue  # reported by the checker (dcpc.check.mesh)
        if spec is None or (isinstance(spec, SizeSpec) and spec.multiple_of is None):
            table.sizes[name] = Size(name, max=getattr(spec, "max", None), axis=axis)
        else:  # a constant or a multiple cannot size an axis (reported): keep it known
            table.sizes[name] = Size(name, broken=True)
    for name, spec in schedule.sizes.items():
        if name == WORLD or name in axes:
            continue  # reported as a reserved name by the checker; an axis' size above
        if not isinstance(spec, SizeSpec):
            table.sizes[name] = Size(name, constant=spec)
            continue
        multiple: ex.Expr | None = None
        if spec.multiple_of is not None:
            try:
                multiple = parse_expr(spec.multiple_of)
            except ex.ExprSyntaxError as err:
                table.diagnostics.append(_syntax_diag(
                    spec.mark("multiple_of"), spec.multiple_of, err, f"multiple_of of '{name}'"
                ))
        table.sizes[name] = Size(name, max=spec.max, multiple_of=multiple)
        if spec.multiple_of is not None and multiple is None:
            # unusable: keep the symbol known (no cascade of unknown-size) but unbound
            table.sizes[name] = Size(name, broken=True)
    for name, buffer in schedule.buffers.items():
        dims: list[ex.Expr] | None = []
        for i, text in enumerate(buffer.shape):
            node = _size_expr(table, text, buffer.mark(f"shape[{i}]"), name,
                              f"dimension {i} of buffer '{name}',")
            if node is None or dims is None:
                dims = None
            else:
                dims.append(node)
        table.shapes[name] = dims
        if buffer.values is not None:
            named = buffer.values.buffers(schedule.buffers)  # read elementwise: the checker's
            integers = [n for n, b in schedule.buffers.items() if not b.dtype.is_float]
            bounds = [None if end in named else
                      _size_expr(table, getattr(buffer.values, end), buffer.values.mark(end),
                                 name, f"'values: {end}' of buffer '{name}',", integers,
                                 partial(_may_bound, schedule, name), schedule.sliced)
                      for end in ("min", "max")]
            if bounds[0] is not None and bounds[1] is not None:
                table.values[name] = (bounds[0], bounds[1])
            elif named:
                table.value_ends[name] = (bounds[0], bounds[1])
    return table


def _may_bound(schedule: Schedule, name: str, other: str) -> bool:
    """Whether integer buffer ``other`` is one a ``values`` end of ``name`` may name as
    far as the hint of a misspelt end goes: not ``name`` itself, not the module's memory,
    not one a step writes (dcpc.check.names refuses those)."""
    theirs = schedule.buffers[other]
    return (other != name and not theirs.is_symmetric and not theirs.persist
            and writer(schedule, other) is None)


def _size_expr(table: SizeTable, text: str | int, mark: Mark, name: str, what: str,
               buffers: Sequence[str] | None = None,
               may_bound: Callable[[str], bool] | None = None,
               split: Mapping[str, int] | None = None) -> ex.Expr | None:
    """A buffer's size expression (a dimension, an end of its ``values``), parsed; None
    when it does not parse (``shape-syntax``) or names a size nobody declared
    (``unknown-size``), both reported in ``table``. ``buffers``: an end of ``values``,
    which may name one of these integer buffers instead (``bound_buffer``): a misspelt
    one is suggested, and a buffer the loops split into slices (``n[c]``) is said so
    (``bad-values``; ``split``: ``Schedule.sliced``); ``may_bound``: of those, the ones
    the hint may suggest."""
    try:
        node = parse_expr(text)
    except ex.ExprSyntaxError as err:
        table.diagnostics.append(_syntax_diag(mark, text, err, what))
        return None
    unknown = sorted(ex.symbols(node) - set(table.sizes))
    for symbol in unknown:
        if buffers is not None and symbol in (split or {}) and node == ("sym", symbol):
            table.diagnostics.append(Diagnostic(
                mark, "bad-values",
                f"{what[:-1]} names buffer '{symbol}', which the steps use by slice "
                f"('{symbol}[i]': its slices {symbol}_0 ..) while '{name}' is used whole: "
                "a bound is read elementwise, slice i by slice i",
                hint=f"use '{name}' by slice too ('{name}[i]', both along the same axis), "
                "or bound it by a size expression",
            ))
            continue
        inside = buffers is not None and symbol in buffers  # 'max: n + 1': n a buffer
        table.diagnostics.append(Diagnostic(
            mark, "unknown-size",
            f"buffer '{name}' uses size '{symbol}', which is not declared under sizes"
            + ("" if buffers is None else
               f" (buffer '{symbol}' bounds only as a whole end: 'max: {symbol}')" if inside
               else " (nor is it an integer buffer)"),
            hint=(f"write 'max: {symbol}' (or 'min: {symbol}') alone, or a size expression"
                  if inside else
                  did_you_mean(symbol, [*table.sizes, *(b for b in buffers or ()
                                                         if may_bound is None or may_bound(b))])
                  or f"declare it, e.g. 'sizes: {{{symbol}: {{max: 1024}}}}'"),
        ))
    return None if unknown else node


def _eval(node: ex.Expr, env: Mapping[str, int]) -> int | None:
    """Value of an expression, or None when a division is inexact or a name unbound."""
    try:
        return ex.evaluate(node, env)
    except (ex.InexactDivision, ex.UnboundSymbol):
        return None


def _candidates(size: Size, world: int, env: Binding | None = None) -> list[int]:
    """Sample values of one symbol for a W: edge values first. Empty: none admissible."""
    if size.name == WORLD:
        return [world]
    if size.broken:
        return []
    if size.axis is not None:
        value = axis_value(size, world)
        return [value] if value is not None else []
    if size.constant is not None:
        return [size.constant]
    if size.multiple_of is not None:
        step = _eval(size.multiple_of, env or {WORLD: world})
        if step is None or step <= 0:
            return []
        values = [step * k for k in (1, 2, 3, 4, 7, 16)]
        if size.max is not None:
            values = [v for v in values if v <= size.max]
        return values
    top = size.max or 1
    return sorted({v for v in (1, 2, 3, top // 2, top - 1, top) if 1 <= v <= top})


def world_env(table: SizeTable, world: int) -> Binding:
    """What a ``multiple_of`` may use at a group size: W and the axes' sizes."""
    env = {WORLD: int(world)}
    for name, size in table.sizes.items():
        if size.axis is not None and size.axis < len(shape_of(world)):
            env[name] = shape_of(world)[size.axis]
    return env


def axis_value(size: Size, world: int) -> int | None:
    """The value of an axis' size at a group size; None past its ``max``."""
    assert size.axis is not None
    shape = shape_of(world)
    value = shape[size.axis] if size.axis < len(shape) else None
    return value if value is not None and (size.max is None or value <= size.max) else None


def sample_bindings(
    table: SizeTable, world: int, *, limit: int = SAMPLES_PER_WORLD, seed: int = 0
) -> list[Binding]:
    """Admissible bindings of every size for a W: a deterministic, small sample.

    The full product of the per-symbol candidates when it is small; otherwise the
    all-smallest and all-largest bindings, a diagonal that gives every candidate of
    every symbol at least once, and seeded random combinations up to ``limit``.
    A symbol with no admissible value (see :func:`world_diagnostics`) makes the
    result empty.
    """
    names = sorted(table.sizes)
    env = world_env(table, world)
    pools = [_candidates(table.sizes[n], world, env) for n in names]
    if any(not pool for pool in pools):
        return []
    total = 1
    for pool in pools:
        total *= len(pool)
        if total > limit:
            break
    if total <= limit:
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*pools)]
    picks: list[tuple[int, ...]] = [tuple(p[0] for p in pools), tuple(p[-1] for p in pools)]
    width = max(len(p) for p in pools)
    picks += [tuple(p[(i + k) % len(p)] for k, p in enumerate(pools)) for i in range(width)]
    rng = random.Random(seed * 7919 + world)
    while len(set(picks)) < limit and len(picks) < 4 * limit:
        picks.append(tuple(rng.choice(p) for p in pools))
    return [dict(zip(names, combo, strict=True)) for combo in dict.fromkeys(picks)][:limit]


def world_diagnostics(
    schedule: Schedule, table: SizeTable, worlds: Sequence[int]
) -> list[Diagnostic]:
    """Size declarations that fail for some W: ``multiple_of`` naming other sizes,
    evaluating to a non-positive or fractional step, or leaving no value under ``max``;
    and constants that are not positive.

    Such sizes are marked broken in ``table``, so that no binding is sampled with
    them and the shapes that use them are not reported again.
    """
    out: list[Diagnostic] = []
    for name, spec in schedule.sizes.items():
        if name == WORLD:
            continue
        value = spec if not isinstance(spec, SizeSpec) else spec.max
        if value is not None and value > MAX_SIZE:
            mark = schedule.mark(f"sizes/{name}") if not isinstance(spec, SizeSpec) else (
                spec.mark("max"))
            out.append(Diagnostic(
                mark, "size-too-large",
                f"size '{name}' is {value}, above the largest size {MAX_SIZE} (2**31-1)",
                hint="sizes and dimensions are at most 2**31-1 (docs/language.md, Limits)",
            ))
            table.sizes[name] = Size(name, broken=True)
            continue
        if not isinstance(spec, SizeSpec):
            if spec <= 0:
                out.append(Diagnostic(
                    schedule.mark(f"sizes/{name}"), "nonpositive-dim",
                    f"size '{name}' is {spec}, but sizes must be positive",
                ))
                table.sizes[name] = Size(name, broken=True)
            continue
        size = table.sizes.get(name)
        if size is None or size.multiple_of is None:
            continue
        mark = spec.mark("multiple_of")
        axes = {n for n, sz in table.sizes.items() if sz.axis is not None}
        others = sorted(ex.symbols(size.multiple_of) - {WORLD} - axes)
        if others:
            out.append(Diagnostic(
                mark, "bad-multiple-of",
                f"multiple_of of '{name}' may use only W and integers, not {', '.join(others)}",
                hint="write the multiple in terms of W, e.g. 'multiple_of: W' or '2*W'",
            ))
            table.sizes[name] = Size(name, broken=True)
            continue
        for world in worlds:
            step = _eval(size.multiple_of, world_env(table, world))
            text = ex.unparse(size.multiple_of)
            if step is None or step <= 0:
                what = "not a whole number" if step is None else f"{step}"
                out.append(Diagnostic(
                    mark, "bad-multiple-of",
                    f"multiple_of of '{name}' ({text}) is {what} for W={world}",
                ))
                table.sizes[name] = Size(name, broken=True)
                break
            if step > MAX_SIZE:
                out.append(Diagnostic(
                    mark, "size-too-large",
                    f"multiple_of of '{name}' ({text}) is {step} for W={world}, above the "
                    f"largest size {MAX_SIZE} (2**31-1)",
                ))
                table.sizes[name] = Size(name, broken=True)
                break
            if size.max is not None and step > size.max:
                out.append(Diagnostic(
                    mark, "empty-size-range",
                    f"size '{name}' has no admissible value for W={world}: "
                    f"the smallest multiple of {text} is {step}, above max {size.max}",
                    hint=f"raise 'max' of '{name}' or narrow the W range",
                ))
                break
    for name, size in list(table.sizes.items()):
        if size.axis is None:
            continue
        for world in worlds:
            if axis_value(size, world) is None:
                spec = schedule.sizes.get(name)
                out.append(Diagnostic(
                    spec.mark("max") if isinstance(spec, SizeSpec) else schedule.mark("mesh"),
                    "empty-size-range",
                    f"mesh size '{name}' is {shape_of(world)[size.axis]} in mesh {world}, "
                    f"above its max {size.max}",
                    hint=f"raise 'max' of '{name}' or narrow the --world shapes"))
                table.sizes[name] = Size(name, broken=True)
                break
    out += _limit_diagnostics(schedule, table, worlds)
    return out


def largest_binding(table: SizeTable, world: int) -> Binding | None:
    """The binding a module allocates for by default at W: every ``max`` size at its
    largest admissible value, every ``multiple_of``-only size at its smallest multiple.
    None when a size has no admissible value (reported elsewhere)."""
    env: Binding = {}
    for name, size in table.sizes.items():
        pool = _candidates(size, world, world_env(table, world))
        if not pool:
            return None
        if size.multiple_of is not None and size.max is not None:
            step = pool[0]
            env[name] = size.max // step * step
        else:
            env[name] = pool[0] if size.multiple_of is not None else max(pool)
    return env


def _limit_diagnostics(
    schedule: Schedule, table: SizeTable, worlds: Sequence[int]
) -> list[Diagnostic]:
    """Dimensions above MAX_SIZE and buffer instances above MAX_BUFFER_BYTES, at the
    largest binding of each W: reported once per buffer, for the first W that fails."""
    out: list[Diagnostic] = []
    bindings = [(w, env) for w in worlds if (env := largest_binding(table, w)) is not None]
    # a buffer is evaluated once per distinct binding of its own sizes, in W order, not
    # once per W (1024 buffers x W 2..1024 took 2.5 s): those are computed once per set
    # of size names
    distinct: dict[tuple[str, ...], list[tuple[int, Binding]]] = {}
    for name, buffer in schedule.buffers.items():
        dims = table.shapes.get(name)
        if not dims:
            continue
        names = tuple(sorted(set().union(*(ex.symbols(n) for n in dims))))
        if names not in distinct:
            seen: dict[tuple[int, ...], tuple[int, Binding]] = {}
            for world, env in bindings:
                seen.setdefault(tuple(env.get(k, -1) for k in names), (world, env))
            distinct[names] = list(seen.values())
        cases = distinct[names]
        # every dimension at every binding at once, a column per dimension (evaluating
        # one binding at a time cost 3 s for 255 buffers that name W at W 2..1024)
        columns = [_eval_column(node, [env for _, env in cases]) for node in dims]
        limit = MAX_BUFFER_BYTES // buffer.dtype.itemsize
        skip, over, counts = [False] * len(cases), [False] * len(cases), [1] * len(cases)
        for column in columns:  # an inexact division is reported by the checker: skipped
            skip = [k or v is None for k, v in zip(skip, column, strict=True)]
            over = [o or (v is not None and v > MAX_SIZE)
                    for o, v in zip(over, column, strict=True)]
            counts = [c * max(v or 0, 0) for c, v in zip(counts, column, strict=True)]
        for j in (j for j in range(len(cases))
                  if not skip[j] and (over[j] or counts[j] > limit)):
            world, env = cases[j]
            values = [column[j] for column in columns]
            big = next((i for i, v in enumerate(values) if v is not None and v > MAX_SIZE), None)
            count = counts[j]
            sizes = ", ".join(f"{k}={env[k]}" for k in sorted(
                set().union(*(ex.symbols(n) for n in dims))) if k != WORLD)
            at = f"W={world}" + (f", {sizes}" if sizes else "")
            if big is not None:
                out.append(Diagnostic(
                    buffer.mark(f"shape[{big}]"), "dim-too-large",
                    f"dimension {big} of buffer '{name}' ({ex.unparse(dims[big])}) is "
                    f"{values[big]} for {at}, above the largest dimension {MAX_SIZE} (2**31-1)",
                    hint="lower the sizes it uses (docs/language.md, Limits)",
                ))
                break
            nbytes = count * buffer.dtype.itemsize
            if nbytes > MAX_BUFFER_BYTES:
                out.append(Diagnostic(
                    schedule.mark(f"buffers/{name}", of_key=True), "buffer-too-large",
                    f"buffer '{name}' needs {nbytes} bytes for {at}, above the limit of "
                    f"{MAX_BUFFER_BYTES} bytes (1 TiB) for one instance",
                    hint="lower the 'max' of its sizes (docs/language.md, Limits)",
                ))
                break
    return out


def _eval_column(node: ex.Expr, envs: Sequence[Binding]) -> list[int | None]:
    """``_eval(node, env)`` for each env, an operator at a time over all of them."""
    kind = node[0]
    if kind == "num":
        return [node[1]] * len(envs)
    if kind == "sym":
        return [env.get(node[1]) for env in envs]
    lhs, rhs = _eval_column(node[1], envs), _eval_column(node[2], envs)
    pairs = zip(lhs, rhs, strict=True)
    if kind == "+":
        return [None if a is None or b is None else a + b for a, b in pairs]
    if kind == "-":
        return [None if a is None or b is None else a - b for a, b in pairs]
    if kind == "*":
        return [None if a is None or b is None else a * b for a, b in pairs]
    return [None if a is None or b is None or b == 0 or a % b else a // b for a, b in pairs]


def max_binding(
    schedule: Schedule, world: int, overrides: Mapping[str, int] | None = None
) -> Binding:
    """The binding the code generator allocates for: every ``max`` size at its max.

    ``multiple_of`` sizes take their value from ``overrides`` (bound at construction)
    and default to the smallest multiple; overrides may also lower a ``max`` size.
    Raises ``ValueError`` when an override is not admissible (an unknown name, not a
    multiple, above the max, not positive) or the schedule's sizes are broken.
    """
    overrides = dict(overrides or {})
    table = size_table(schedule)
    env: Binding = {WORLD: world}
    for name in overrides:
        if name not in table.sizes or name == WORLD:
            raise ValueError(f"'{name}' is not a size of schedule '{schedule.schedule}'")
    for name, size in table.sizes.items():
        if name == WORLD:
            continue
        if size.axis is not None:
            value = axis_value(size, world)
            if value is None or (name in overrides and overrides[name] != value):
                raise ValueError(f"size '{name}' is set by the mesh shape {world}")
            env[name] = value
            continue
        if size.constant is not None:
            if name in overrides and overrides[name] != size.constant:
                raise ValueError(f"size '{name}' is the constant {size.constant}")
            env[name] = size.constant
            continue
        step = 1
        if size.multiple_of is not None:
            value = _eval(size.multiple_of, world_env(table, world))
            if value is None or value <= 0:
                raise ValueError(f"multiple_of of '{name}' is not a positive integer for W={world}")
            step = value
        default = size.max if size.max is not None and size.multiple_of is None else step
        value = overrides.get(name, default)
        if value <= 0 or value % step:
            raise ValueError(f"size '{name}' = {value} is not a positive multiple of {step}")
        if size.max is not None and value > size.max:
            raise ValueError(f"size '{name}' = {value} is above its max {size.max}")
        env[name] = value
    return env
