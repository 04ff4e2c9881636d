"""Evaluate the shape ASTs that generated modules carry (never ``eval``).

An expression is ``("num", n) | ("sym", name) | (op, lhs, rhs)`` with op in ``+ - * /``;
``/`` is exact. This mirrors ``dcpc.lang.expr`` without importing the compiler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Expr = tuple


def evaluate(expr: Expr, env: Mapping[str, int]) -> int:
    """The value of ``expr``; ValueError on an inexact division, KeyError if unbound."""
    kind = expr[0]
    if kind == "num":
        return int(expr[1])
    if kind == "sym":
        return env[expr[1]]
    lhs, rhs = evaluate(expr[1], env), evaluate(expr[2], env)
    if kind == "+":
        return lhs + rhs
    if kind == "-":
        return lhs - rhs
    if kind == "*":
        return lhs * rhs
    if rhs == 0 or lhs % rhs:
        raise ValueError(f"{unparse(expr)} is {lhs}/{rhs}, which is not a whole number")
    return lhs // rhs


def shape(exprs: Sequence[Expr], env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(e, env) for e in exprs)


def product(exprs: Sequence[Expr], env: Mapping[str, int]) -> int:
    n = 1
    for e in exprs:
        n *= evaluate(e, env)
    return n


def symbols(expr: Expr) -> set[str]:
    if expr[0] == "num":
        return set()
    if expr[0] == "sym":
        return {expr[1]}
    return symbols(expr[1]) | symbols(expr[2])


def linear_in(expr: Expr, name: str, env: Mapping[str, int]) -> tuple[int, int] | None:
    """``(a, b)`` with ``expr == a * name + b`` for every value of ``name``, else None.

    Used once at construction so that binding a size from a tensor dimension at call
    time is ``(dim - b) // a``. Probing at three points rejects non-linear expressions.
    """
    try:
        y0, y1, y2 = (evaluate(expr, {**env, name: x}) for x in (0, 1, 2))
    except (ValueError, KeyError):
        return None
    a, b = y1 - y0, y0
    if a <= 0 or y2 != 2 * a + b:
        return None
    return a, b


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def unparse(expr: Expr, parent: int = 0, right: bool = False) -> str:
    kind = expr[0]
    if kind in ("num", "sym"):
        return str(expr[1])
    prec = _PREC[kind]
    text = f"{unparse(expr[1], prec)}{kind}{unparse(expr[2], prec, True)}"
    return f"({text})" if prec < parent or (right and prec == parent) else text
