"""The shape questions of the checker (are two shapes equal? is a division always
whole? can a dimension be zero or negative?), decided exactly over every admissible
binding of the sizes for every W asked (``dcpc.lang.exact``), or refused.

``ctx.samples`` of the structural checks is a ``Samples``; a failed question comes back
as a ``Counterexample`` binding, which the diagnostics print.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from dcpc.lang import exact
from dcpc.lang import expr as ex
from dcpc.lang.sizes import WORLD, Binding, SizeTable, _eval, sample_bindings

UNDECIDED = "it cannot be decided exactly: "  # an undecided answer's detail, then the reason


@dataclass(frozen=True)
class Counterexample:
    """A binding (W included) under which a shape question fails; ``undecided``: the
    question could not be decided exactly (``detail`` says why) and is refused."""

    binding: Binding
    detail: str = ""
    undecided: bool = False
    spent: bool = False  # undecided because the check's questions together spent the budget

    @property
    def world(self) -> int:
        return self.binding[WORLD]

    def names(self, nodes: Iterable[ex.Expr]) -> str:
        """``"H=6, T=1"``: the binding of the symbols (W aside) that ``nodes`` use."""
        used = sorted(set().union(*(ex.symbols(n) for n in nodes)) - {WORLD})
        return ", ".join(f"{name}={self.binding[name]}" for name in used if name in self.binding)


def space_of(table: SizeTable, worlds: Sequence[int]) -> exact.Space:
    """The admissible bindings of a size table as an exact ``Space`` (W first)."""
    variables = [exact.Var(WORLD, "world")]
    constants: dict[str, int] = {}
    broken = False
    for name in sorted(table.sizes):
        size = table.sizes[name]
        if name == WORLD:
            continue
        if size.broken:
            broken = True
        elif size.axis is not None:
            variables.append(exact.Var(name, "axis", size.max, axis=size.axis))
        elif size.constant is not None:
            constants[name] = size.constant
        elif size.multiple_of is not None:
            variables.append(exact.Var(name, "multiple", size.max, size.multiple_of))
        else:
            variables.append(exact.Var(name, "range", size.max or 1))
    if broken:  # its error is reported; like an empty sample, nothing is asked
        return exact.Space([exact.Var(WORLD, "world")], {}, [], broken=True)
    axes = sorted((s.axis, n) for n, s in table.sizes.items() if s.axis is not None)
    world: ex.Expr | None = None
    for _, name in axes:  # a mesh's W is the product of its axes' sizes
        world = ("sym", name) if world is None else ("*", world, ("sym", name))
    if table.mesh_constants:
        for value in table.mesh_constants:
            node: ex.Expr = ("num", value)
            world = node if world is None else ("*", world, node)
    return exact.Space(variables, constants, worlds, world=world)


class Samples:
    """The shape questions of the checker, decided exactly over every admissible
    binding of every W asked (``dcpc.lang.exact``). The name is historical: sampled
    bindings remain only as the search for a witness of a division that does not
    divide as polynomials (``H/W`` with H a ``max`` size), which such a witness ends."""

    def __init__(self, table: SizeTable, worlds: Sequence[int]):
        self.table = table
        self.worlds = list(worlds)
        self.space = space_of(table, self.worlds)
        self._by_world: dict[int, list[Binding]] | None = None
        # each question answered once per check: a question asked again (the same
        # dimension of several buffers, a division inside a larger one) costs no budget
        self._answers: dict[tuple, Counterexample | None] = {}

    def _once(self, key: tuple, ask: Callable[[], Counterexample | None]
              ) -> Counterexample | None:
        if key not in self._answers:
            self._answers[key] = ask()
        return self._answers[key]

    @property
    def by_world(self) -> dict[int, list[Binding]]:
        if self._by_world is None:
            self._by_world = {w: sample_bindings(self.table, w) for w in self.worlds}
        return self._by_world

    def __iter__(self) -> Iterable[Binding]:  # type: ignore[override]
        for world in self.worlds:
            yield from self.by_world[world]

    def _refused(self, err: exact.Undecided) -> Counterexample:
        world = self.space.worlds[0] if self.space.worlds else self.worlds[0]
        return Counterexample(self.space.binding(tuple(self.space.base(world))),
                              f"{UNDECIDED}{err}", undecided=True,
                              spent=err.spent)

    def inexact(self, node: ex.Expr) -> Counterexample | None:
        """A binding under which a division in ``node`` is inexact (or by zero), or None
        when every division is whole for every admissible binding."""
        if self.space.broken or not self.space.worlds:
            return None
        return self._once(("inexact", node), lambda: self._inexact_or_refused(node))

    def _inexact_or_refused(self, node: ex.Expr) -> Counterexample | None:
        try:
            return self._inexact(node)
        except exact.Undecided as err:
            return self._refused(err)

    def _inexact_once(self, node: ex.Expr) -> Counterexample | None:
        """An inner division's answer, asked once (an undecided one raises again, so the
        outer question is refused with it)."""
        found = self.inexact(node)
        if found is not None and found.undecided:
            raise exact.Undecided(found.detail.removeprefix(UNDECIDED),
                                  spent=found.spent)
        return found

    def _inexact(self, node: ex.Expr) -> Counterexample | None:
        if node[0] in ("num", "sym"):
            return None
        found = self._inexact_once(node[1]) or self._inexact_once(node[2])
        if found is not None or node[0] != "/":
            return found
        space = self.space
        divisor = space.poly(node[2])
        point = space.find(divisor, lambda v: v == 0, zero_only=True)
        if point is None:
            try:
                quotient = space.poly(node)
            except exact.NotPolynomial:
                return self._enumerate(node)
            point = exact.integer_residues(quotient, space)
        return None if point is None else self._division_at(node, space.binding(point))

    def _enumerate(self, node: ex.Expr) -> Counterexample | None:
        """A division that is not one of polynomials (``D/W`` with D a constant, ``H/W``
        with H a ``max`` size): tried at every point of the sizes it uses, or refused
        when those are too many and the samples hold no witness either."""
        names = ex.symbols(node)
        try:
            for point in self.space.points(names):
                env = self.space.binding(point)
                try:
                    ex.evaluate(node, env)
                except ex.InexactDivision as err:
                    return Counterexample(env, ex.unparse(err.expr))
        except exact.Undecided as err:
            return self._witness(node) or self._refused(exact.Undecided(
                f"{ex.unparse(node)} does not divide as a polynomial and {err}",
                spent=err.spent))
        return None

    def _division_at(self, node: ex.Expr, env: Binding) -> Counterexample:
        try:
            ex.evaluate(node, env)
        except ex.InexactDivision as err:
            return Counterexample(env, ex.unparse(err.expr))
        return Counterexample(env, ex.unparse(node))

    def _witness(self, node: ex.Expr) -> Counterexample | None:
        for env in self:
            try:
                ex.evaluate(node, env)
            except ex.InexactDivision as err:
                return Counterexample(env, ex.unparse(err.expr))
            except ex.UnboundSymbol:
                return None
        return None

    def nonpositive(self, node: ex.Expr) -> Counterexample | None:
        """A binding under which ``node`` is zero or negative, or None when it is
        positive for every admissible binding (divisions assumed whole: checked first)."""
        if self.space.broken or not self.space.worlds:
            return None
        return self._once(("nonpositive", node), lambda: self._nonpositive(node))

    def _nonpositive(self, node: ex.Expr) -> Counterexample | None:
        try:
            poly = self.space.poly(node)
            point = self.space.find(poly, lambda v: v <= 0)
        except exact.NotPolynomial:
            return None  # an inexact division: reported by inexact()
        except exact.Undecided as err:
            return self._refused(err)
        if point is None:
            return None
        env = self.space.binding(point)
        return Counterexample(env, str(_eval(node, env)))

    def shapes_differ(
        self, expected: Sequence[ex.Expr], actual: Sequence[ex.Expr]
    ) -> Counterexample | None:
        """A binding where two shapes of the same rank differ, or None if they are equal
        for every admissible binding. Bindings under which either side does not
        evaluate (an inexact division, reported elsewhere) are skipped. ``detail``
        holds both concrete shapes."""
        if self.space.broken or not self.space.worlds:
            return None
        return self._once(("differ", tuple(expected), tuple(actual)),
                          lambda: self._shapes_differ(expected, actual))

    def _shapes_differ(
        self, expected: Sequence[ex.Expr], actual: Sequence[ex.Expr]
    ) -> Counterexample | None:
        space = self.space
        best: exact.Point | None = None
        try:
            for want, have in zip(expected, actual, strict=True):
                point = space.nonzero_point(
                    exact._add(space.poly(want), exact._scale(space.poly(have), Fraction(-1))))
                if point is not None and (best is None or point < best):
                    best = point
        except exact.NotPolynomial:
            return self._differ_sampled(expected, actual)
        except exact.Undecided as err:
            return self._refused(err)
        if best is None:
            return None
        env = space.binding(best)
        want = [_eval(n, env) for n in expected]
        got = [_eval(n, env) for n in actual]
        if None in want or None in got:
            return self._differ_sampled(expected, actual)
        return Counterexample(env, f"needs {want}, has {got}")

    def _differ_sampled(
        self, expected: Sequence[ex.Expr], actual: Sequence[ex.Expr]
    ) -> Counterexample | None:
        """A division that is not whole everywhere is reported by inexact(); compare
        where both sides evaluate, on the sampled bindings."""
        for env in self:
            want = [_eval(n, env) for n in expected]
            got = [_eval(n, env) for n in actual]
            if None in want or None in got:
                continue
            if want != got:
                return Counterexample(env, f"needs {want}, has {got}")
        return None


def equal_on_samples(a: ex.Expr, b: ex.Expr, samples: Samples) -> bool:
    """Equality of two expressions for every admissible binding (decided exactly)."""
    return samples.shapes_differ([a], [b]) is None
