"""Evaluate the shape ASTs that generated modules carry (never ``eval``).

The expressions themselves (AST, ``evaluate``, ``symbols``, ``unparse``) are defined
once in ``dcpc.exprs``, which the compiler uses too; this adds what a module needs at
call time: whole shapes, products and binding a size from a tensor dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dcpc.exprs import (  # noqa: F401  (generated modules and the runtime use these names)
    Expr,
    InexactDivision,
    UnboundSymbol,
    evaluate,
    holds,
    symbols,
    unparse,
)


def shape(exprs: Sequence[Expr], env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(e, env) for e in exprs)


def product(exprs: Sequence[Expr], env: Mapping[str, int]) -> int:
    n = 1
    for e in exprs:
        n *= evaluate(e, env)
    return n


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
