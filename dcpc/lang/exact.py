"""Exact answers to the shape questions of ``dcpc check``, over every admissible binding.

A shape expression is an integer polynomial in the sizes, with exact division. Over a
space of bindings (W in the group sizes asked; a ``max`` size in 1..max; a
``multiple_of`` size k*m(W) with k in 1..max//m(W), or unbounded; constants fixed)
each question is decided exactly, never on samples:

- equality of two expressions: their difference is the zero polynomial, or a
  nonzero point is found on a grid of deg+1 values per variable (a nonzero
  polynomial of degree d in a variable cannot vanish on d+1 of its values), for every W;
- a value that can be zero or negative: none when the polynomial, shifted to each
  variable's lower bound, has only non-negative coefficients and a positive constant;
  else an exact search (every W, every small domain, and for the last variable its
  integers inside a root bound);
- an inexact division a/b: b is never zero (as above), b divides a as polynomials, and
  the quotient's rational coefficients give an integer at every residue of the
  variables modulo their common denominator.

What these cannot settle within their budgets raises ``Undecided``; the checker then
refuses the shape with a located diagnostic rather than guess.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from dcpc.lang import expr as ex
from dcpc.lang.mesh import shape_of

Mono = tuple[int, ...]
Poly = dict[Mono, Fraction]
Point = tuple[int, ...]

MAX_TERMS = 2_000  # terms of one polynomial (shape expressions have a handful)
MAX_POINTS = 20_000  # polynomial evaluations for one question (about 0.1 s)
# ... and for every question of one check together: 1,000 buffers of a square of two
# large sizes each spent MAX_POINTS (300 s at W 2..1024, issue 31); past it the rest
# are refused (shape-undecided), never passed
MAX_TOTAL_POINTS = 50_000
MAX_ROOT_SPAN = 20_000  # integers searched inside a univariate root bound


class Undecided(Exception):
    """The question is past this module's budgets; the message says which. ``spent``:
    the budget of every question of the check together (MAX_TOTAL_POINTS), which other
    expressions of the file may have spent, not one question's own."""

    def __init__(self, message: str, *, spent: bool = False) -> None:
        super().__init__(message)
        self.spent = spent


class NotPolynomial(Exception):
    """A division whose divisor does not divide the dividend as polynomials."""


@dataclass(frozen=True)
class Var:
    """One variable: W (the group size), a ``max`` size, or the multiplier k of a
    ``multiple_of`` size (its value is k * step(W))."""

    name: str
    kind: str  # "world" | "range" | "multiple" | "axis"
    top: int | None = None  # max of a range; max of the size for a multiple
    step: ex.Expr | None = None  # a multiple's step, an expression of W (and axes)
    axis: int = 0  # an axis' size (dcpc.lang.mesh): its position; its one value per W

    @property
    def by_world(self) -> bool:
        """Whether its domain depends on the group size."""
        return self.kind == "axis" or (self.kind == "multiple" and self.top is not None)


class Space:
    """The admissible bindings of a schedule's sizes for a list of group sizes."""

    def __init__(self, variables: Sequence[Var], constants: Mapping[str, int],
                 worlds: Sequence[int], broken: bool = False, world: ex.Expr | None = None):
        self.world_expr = world  # a mesh's W: the product of its axes' sizes
        self.vars = list(variables)
        self.index = {v.name: i for i, v in enumerate(self.vars)}
        self.constants = dict(constants)
        self.broken = broken
        # the W for which every size has a value (others are reported elsewhere)
        self.worlds = [w for w in worlds if all(self._domain(i, w) != (1, 0)
                                                for i in range(1, len(self.vars)))]
        self._polys: dict[ex.Expr, Poly] = {}
        self.spent = 0  # evaluations of every question so far (MAX_TOTAL_POINTS)

    def spend(self, count: int) -> None:
        """Count ``count`` evaluations against the budget of all questions together."""
        self.spent += count
        if self.spent > MAX_TOTAL_POINTS:
            raise Undecided(f"the schedule's shape questions together need more than "
                            f"{MAX_TOTAL_POINTS} evaluations", spent=True)

    # ---- domains --------------------------------------------------------------------
    def step_at(self, var: Var, world: int) -> int:
        assert var.step is not None
        return ex.evaluate(var.step, self._world_env(world))

    def _world_env(self, world: int) -> dict[str, int]:
        env = {"W": int(world)}
        for var in self.vars:
            if var.kind == "axis":
                env[var.name] = self._axis(var, world)
        return env

    @staticmethod
    def _axis(var: Var, world: int) -> int:
        shape = shape_of(world)
        return shape[var.axis] if var.axis < len(shape) else 0

    def _domain(self, i: int, world: int) -> tuple[int, int | None]:
        """``(lo, hi)`` of variable i (not W) at a W; hi None: unbounded."""
        var = self.vars[i]
        if var.kind == "range":
            return 1, var.top
        if var.kind == "axis":
            value = self._axis(var, world)
            ok = value >= 1 and (var.top is None or value <= var.top)
            return (value, value) if ok else (1, 0)
        if var.top is None:
            return 1, None
        step = self.step_at(var, world)
        return (1, var.top // step) if var.top // step >= 1 else (1, 0)

    def first_values(self, i: int, world: int, count: int) -> list[int]:
        lo, hi = self._domain(i, world)
        top = lo + count - 1 if hi is None else min(hi, lo + count - 1)
        return list(range(lo, top + 1))

    def binding(self, point: Point) -> dict[str, int]:
        """The sizes of a point: W, every size by name (a multiple is k * step(W))."""
        world = point[0]
        out = {"W": world, **self.constants}
        for var, value in zip(self.vars[1:], point[1:], strict=True):
            out[var.name] = value * self.step_at(var, world) if var.kind == "multiple" else value
        return out

    def base(self, world: int) -> list[int]:
        """Every variable at its lowest value (an axis' size at its one value)."""
        return [world] + [self._domain(i, world)[0] if self.vars[i].kind == "axis" else 1
                          for i in range(1, len(self.vars))]

    # ---- expressions as polynomials -------------------------------------------------
    def poly(self, node: ex.Expr) -> Poly:
        """The polynomial of an expression; NotPolynomial for a division that is not one."""
        if node not in self._polys:
            self._polys[node] = self._convert(node)
        return self._polys[node]

    def _convert(self, node: ex.Expr) -> Poly:
        zero = (0,) * len(self.vars)
        kind = node[0]
        if kind == "num":
            return {zero: Fraction(node[1])} if node[1] else {}
        if kind == "sym":
            name = node[1]
            if name == "W" and self.world_expr is not None:
                return self.poly(self.world_expr)
            if name in self.constants:
                return {zero: Fraction(self.constants[name])} if self.constants[name] else {}
            if name not in self.index:
                raise Undecided(f"size '{name}' has no admissible value")
            i = self.index[name]
            mono = tuple(1 if j == i else 0 for j in range(len(self.vars)))
            var = {mono: Fraction(1)}
            if self.vars[i].kind == "multiple":
                assert self.vars[i].step is not None
                return _mul(var, self.poly(self.vars[i].step))
            return var
        lhs, rhs = self.poly(node[1]), self.poly(node[2])
        if kind == "+":
            return _add(lhs, rhs)
        if kind == "-":
            return _add(lhs, _scale(rhs, Fraction(-1)))
        if kind == "*":
            return _mul(lhs, rhs)
        return _divide(lhs, rhs)

    # ---- search ---------------------------------------------------------------------
    def points(self, names: set[str]) -> Iterator[Point]:
        """Every point that differs in the variables ``names`` use (others at their
        lowest value), W outermost; Undecided after MAX_POINTS of them."""
        used = [i for i in range(1, len(self.vars)) if self.vars[i].name in names]
        budget = MAX_POINTS
        for world in self.worlds:
            spans = [self._domain(i, world) for i in used]
            pools = [range(lo, (hi if hi is not None else lo + MAX_POINTS) + 1)
                     for lo, hi in spans]
            point = self.base(world)
            for values in itertools.product(*pools):
                budget -= 1
                if budget < 0:
                    raise Undecided("it has too many cases to try them all")
                self.spend(1)
                for i, v in zip(used, values, strict=True):
                    point[i] = v
                yield tuple(point)
            if "W" not in names and not any(self.vars[i].by_world for i in used):
                return  # nothing it uses depends on W

    def nonzero_point(self, poly: Poly) -> Point | None:
        """A point where ``poly`` is not zero, in order of W then smallest values; None
        when it is zero on the whole space. Exact (see the module's doc)."""
        if not poly:
            return None
        for point in self._grid(poly):
            if evaluate(poly, point):
                return point
        return None

    def _grid(self, poly: Poly) -> Iterator[Point]:
        degrees = [max(m[i] for m in poly) for i in range(len(self.vars))]
        budget = MAX_POINTS
        for world in self.worlds:
            pools = [self.first_values(i, world, degrees[i] + 1)
                     for i in range(1, len(self.vars))]
            size = 1
            for pool in pools:
                size *= len(pool)
            budget -= size
            if budget < 0:
                raise Undecided("the expressions have too high a degree to compare")
            self.spend(size)
            for rest in itertools.product(*pools):
                yield (world, *rest)

    def find(self, poly: Poly, bad: Callable[[Fraction], bool], zero_only: bool = False
             ) -> Point | None:
        """A point where ``bad(value)`` holds (bad is ``<= 0`` or ``== 0``), or None when
        there is none in the space. Undecided past the budgets."""
        if _positive_shifted(poly, self._lows()) or (
            zero_only and _positive_shifted(_scale(poly, Fraction(-1)), self._lows())
        ):
            return None
        used = [i for i in range(1, len(self.vars)) if any(m[i] for m in poly)]
        # W matters when the polynomial or a used multiple's range depends on it
        by_world = any(m[0] for m in poly) or any(self.vars[i].by_world for i in used)
        budget = [MAX_POINTS]
        for world in self.worlds if by_world else self.worlds[:1]:
            found = self._find_at(poly, bad, world, used, budget)
            if found is not None:
                return found
        return None

    def _lows(self) -> list[int]:
        lows = [min(self.worlds, default=1)] + [1] * (len(self.vars) - 1)
        for i, var in enumerate(self.vars):
            if var.kind == "axis" and self.worlds:
                lows[i] = min(self._axis(var, w) for w in self.worlds)
        return lows

    def _find_at(self, poly: Poly, bad: Callable[[Fraction], bool], world: int,
                 used: list[int], budget: list[int]) -> Point | None:
        point = self.base(world)
        if not used:
            budget[0] -= 1
            self.spend(1)
            return tuple(point) if bad(evaluate(poly, tuple(point))) else None
        spans = {i: self._domain(i, world) for i in used}
        last = max(used, key=lambda i: float("inf") if spans[i][1] is None
                   else spans[i][1] - spans[i][0])
        outer = [i for i in used if i != last]
        pools = []
        for i in outer:
            lo, hi = spans[i]
            if hi is None or hi - lo + 1 > MAX_POINTS:
                raise Undecided("the expression depends on several large sizes at once")
            pools.append(range(lo, hi + 1))
        for values in itertools.product(*pools):
            for i, v in zip(outer, values, strict=True):
                point[i] = v
            coeffs = _univariate(poly, tuple(point), last)
            lo, hi = spans[last]
            before = budget[0]
            candidates = list(_candidates(coeffs, lo, hi, budget))
            self.spend(1 + before - budget[0])
            # over a common denominator the sign and zeros are the integer polynomial's,
            # evaluated in ints (Fraction arithmetic was most of a large search's time)
            scale = math.lcm(*(c.denominator for c in coeffs)) if coeffs else 1
            whole = [int(c * scale) for c in coeffs]
            for x in candidates:
                point[last] = x
                if bad(_horner(whole, x)):
                    return tuple(point)
        return None


def evaluate(poly: Poly, point: Point) -> Fraction:
    total = Fraction(0)
    for mono, coeff in poly.items():
        term = coeff
        for x, e in zip(point, mono, strict=True):
            if e:
                term *= x**e
        total += term
    return total


def integer_residues(poly: Poly, space: Space) -> Point | None:
    """A point where ``poly`` (rational coefficients) is not an integer, or None: an
    integer polynomial over the common denominator L repeats modulo L in every
    variable, so one value per residue class of each domain decides it."""
    den = 1
    for coeff in poly.values():
        den = den * coeff.denominator // _gcd(den, coeff.denominator)
    if den == 1:
        return None
    used = [i for i in range(len(space.vars)) if any(m[i] for m in poly)]
    # every W when the polynomial or a multiple's range depends on it
    by_world = 0 in used or any(space.vars[i].kind in ("multiple", "axis") for i in used)
    checked = 0
    for world in space.worlds if by_world else space.worlds[:1]:
        pools = [space.first_values(i, world, den) if i in used else [1]
                 for i in range(1, len(space.vars))]
        for rest in itertools.product(*pools):
            checked += 1
            if checked > MAX_POINTS:
                raise Undecided("the division's remainders have too many cases")
            space.spend(1)
            point = (world, *rest)
            if evaluate(poly, point).denominator != 1:
                return point
    return None


# ---- polynomial arithmetic (dicts of exponent tuples) ---------------------------------

def _add(a: Poly, b: Poly) -> Poly:
    out = dict(a)
    for mono, coeff in b.items():
        value = out.get(mono, 0) + coeff
        if value:
            out[mono] = value
        else:
            out.pop(mono, None)
    return out


def _scale(a: Poly, c: Fraction) -> Poly:
    return {m: v * c for m, v in a.items()} if c else {}


def _mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for m1, c1 in a.items():
        for m2, c2 in b.items():
            mono = tuple(x + y for x, y in zip(m1, m2, strict=True))
            value = out.get(mono, 0) + c1 * c2
            if value:
                out[mono] = value
            else:
                out.pop(mono, None)
    if len(out) > MAX_TERMS:
        raise Undecided(f"the expression expands to more than {MAX_TERMS} terms")
    return out


def _divide(a: Poly, b: Poly) -> Poly:
    """a / b as a polynomial (over the rationals), or NotPolynomial. With one divisor,
    long division in lex order leaves no remainder exactly when b divides a."""
    if not b:
        raise NotPolynomial("division by zero")
    lead = max(b)
    quotient: Poly = {}
    rest = dict(a)
    for _ in range(MAX_TERMS):
        if not rest:
            return quotient
        top = max(rest)
        if any(x < y for x, y in zip(top, lead, strict=True)):
            raise NotPolynomial("the divisor does not divide the dividend")
        mono = tuple(x - y for x, y in zip(top, lead, strict=True))
        coeff = rest[top] / b[lead]
        quotient[mono] = coeff
        rest = _add(rest, _scale(_mul({mono: coeff}, b), Fraction(-1)))
    raise Undecided("the division has too many terms")


def _positive_shifted(poly: Poly, lows: Sequence[int]) -> bool:
    """True when ``poly`` > 0 for every point >= lows: substituted x = low + u (u >= 0),
    every coefficient is >= 0 and the constant term is > 0."""
    if not poly:
        return False
    shifted: Poly = {}
    for mono, coeff in poly.items():
        term: Poly = {(0,) * len(lows): coeff}
        for i, e in enumerate(mono):
            if e:
                base: Poly = {tuple(1 if j == i else 0 for j in range(len(lows))): Fraction(1)}
                if lows[i]:
                    base[(0,) * len(lows)] = Fraction(lows[i])
                for _ in range(e):
                    term = _mul(term, base)
        shifted = _add(shifted, term)
    const = shifted.get((0,) * len(lows), Fraction(0))
    return const > 0 and all(c >= 0 for c in shifted.values())


def _univariate(poly: Poly, point: Point, var: int) -> list[Fraction]:
    """Coefficients (constant first) of ``poly`` in variable ``var``, others at ``point``."""
    coeffs: dict[int, Fraction] = {}
    for mono, coeff in poly.items():
        term = coeff
        for j, (x, e) in enumerate(zip(point, mono, strict=True)):
            if e and j != var:
                term *= x**e
        coeffs[mono[var]] = coeffs.get(mono[var], Fraction(0)) + term
    degree = max(coeffs, default=0)
    return [coeffs.get(k, Fraction(0)) for k in range(degree + 1)]


def _horner(coeffs: Sequence[Fraction] | Sequence[int], x: int) -> Fraction | int:
    value: Fraction | int = 0
    for c in reversed(coeffs):
        value = value * x + c
    return value


def _candidates(coeffs: list[Fraction], lo: int, hi: int | None, budget: list[int]
                ) -> Iterator[int]:
    """Integers of [lo, hi] that decide the sign of a univariate polynomial there: all
    of them inside a bound on its real roots (Fujiwara's), and the bound's ends (the
    sign is constant beyond it)."""
    while len(coeffs) > 1 and not coeffs[-1]:
        coeffs = coeffs[:-1]
    degree = len(coeffs) - 1
    if degree <= 0:
        yield lo
        return
    lead = abs(coeffs[-1])
    bound = 1
    for k in range(1, degree + 1):
        ratio = abs(coeffs[degree - k]) / lead
        if k == degree:
            ratio /= 2
        root = _root_ceiling(ratio, k)
        bound = max(bound, 2 * root)
    start = lo
    stop = bound + 1 if hi is None else min(hi, bound + 1)
    if stop - start + 1 > MAX_ROOT_SPAN:
        raise Undecided("the expression's roots lie too far apart to search")
    budget[0] -= max(0, stop - start + 1)
    if budget[0] < 0:
        raise Undecided("the expression has too many cases to search")
    yield from range(start, stop + 1)


def _root_ceiling(value: Fraction, k: int) -> int:
    """The smallest integer r >= 0 with r**k >= value."""
    if value <= 0:
        return 0
    r = max(1, int(float(value) ** (1.0 / k)))
    while r**k < value:
        r += 1
    while r > 1 and (r - 1) ** k >= value:
        r -= 1
    return r


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
