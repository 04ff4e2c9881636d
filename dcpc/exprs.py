"""Shape and size expressions as values: the AST, evaluation and printing, defined once.

An expression is ``("num", n) | ("sym", name) | (op, lhs, rhs)`` with op in ``+ - * /``;
``/`` is exact; ``%`` (Python's remainder) only where the parser is asked for it (a
shift's ``perm``, dcpc.lang.expr.parse). Stdlib only, never ``eval``: the compiler
(``dcpc.lang.expr`` adds the parser) and the runtime (``dcpc.runtime.shapes``, which
generated modules use to evaluate the ASTs they carry) both import it.
"""

from __future__ import annotations

from collections.abc import Mapping

Expr = tuple  # ("num", int) | ("sym", str) | (op, Expr, Expr)


class InexactDivision(ArithmeticError, ValueError):
    """``/`` on values that do not divide (a ValueError too, for the runtime's callers)."""

    def __init__(self, expr: Expr, lhs: int, rhs: int):
        super().__init__(f"{unparse(expr)} is {lhs}/{rhs}, which is not a whole number")
        self.expr, self.lhs, self.rhs = expr, lhs, rhs


class UnboundSymbol(KeyError):
    pass


def evaluate(expr: Expr, env: Mapping[str, int]) -> int:
    """The value of ``expr``; InexactDivision (a ValueError) on an inexact division,
    UnboundSymbol (a KeyError) for a name ``env`` does not bind."""
    kind = expr[0]
    if kind == "num":
        return int(expr[1])
    if kind == "sym":
        if expr[1] not in env:
            raise UnboundSymbol(expr[1])
        return env[expr[1]]
    lhs, rhs = evaluate(expr[1], env), evaluate(expr[2], env)
    if kind == "+":
        return lhs + rhs
    if kind == "-":
        return lhs - rhs
    if kind == "*":
        return lhs * rhs
    if kind == "%":  # only where the parser was asked for it (a shift's perm: rank arithmetic)
        if rhs == 0:
            raise ZeroDivisionError(f"{unparse(expr)} takes a remainder by 0")
        return lhs % rhs
    if rhs == 0 or lhs % rhs:
        raise InexactDivision(expr, lhs, rhs)
    return lhs // rhs


def symbols(expr: Expr) -> set[str]:
    if expr[0] == "num":
        return set()
    if expr[0] == "sym":
        return {expr[1]}
    return symbols(expr[1]) | symbols(expr[2])


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "%": 2}


def unparse(expr: Expr, parent: int = 0, right: bool = False) -> str:
    kind = expr[0]
    if kind in ("num", "sym"):
        return str(expr[1])
    prec = _PREC[kind]
    text = f"{unparse(expr[1], prec)}{kind}{unparse(expr[2], prec, True)}"
    return f"({text})" if prec < parent or (right and prec == parent) else text
