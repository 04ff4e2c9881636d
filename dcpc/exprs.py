"""Shape and size expressions as values: the AST, evaluation and printing, defined once.

An expression is ``("num", n) | ("sym", name) | (op, lhs, rhs)`` with op in ``+ - * /``;
``/`` is exact. A condition (a step's ``when:``) adds ``%`` (an integer's remainder, the
sign of the divisor's, as Python's), the comparisons ``< <= > >= == !=`` and ``and`` /
``or`` / ``("not", c)``: ``holds`` evaluates one. Stdlib only, never ``eval``: the
compiler (``dcpc.lang.expr`` adds the parser) and the runtime (``dcpc.runtime.shapes``,
which generated modules use to evaluate the ASTs they carry) both import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Expr = tuple  # ("num", int) | ("sym", str) | (op, Expr, Expr)


class InexactDivision(ArithmeticError, ValueError):
    """``/`` on values that do not divide (a ValueError too, for the runtime's callers)."""

    def __init__(self, expr: Expr, lhs: int, rhs: int):
        super().__init__(f"{unparse(expr)} is {lhs}/{rhs}, which is not a whole number")
        self.expr, self.lhs, self.rhs = expr, lhs, rhs


class RemainderByZero(ZeroDivisionError, ValueError):
    """``%`` by 0 (a condition's or a perm's remainder)."""


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
    if kind == "%":
        if rhs == 0:
            raise RemainderByZero(f"{unparse(expr)} is {lhs} % 0, which has no value")
        return lhs % rhs
    if rhs == 0 or lhs % rhs:
        raise InexactDivision(expr, lhs, rhs)
    return lhs // rhs


COMPARISONS = ("<=", ">=", "==", "!=", "<", ">")  # longest first: how the tokenizer reads them


def holds(cond: Expr, env: Mapping[str, int]) -> bool:
    """Whether condition ``cond`` holds in ``env`` (the errors of ``evaluate``; a
    ValueError for a tree that is not a condition)."""
    kind = cond[0]
    if kind == "not":
        return not holds(cond[1], env)
    if kind == "and":
        return holds(cond[1], env) and holds(cond[2], env)
    if kind == "or":
        return holds(cond[1], env) or holds(cond[2], env)
    if kind not in COMPARISONS:
        raise ValueError(f"'{unparse(cond)}' is not a condition")
    lhs, rhs = evaluate(cond[1], env), evaluate(cond[2], env)
    return {"<": lhs < rhs, "<=": lhs <= rhs, ">": lhs > rhs, ">=": lhs >= rhs,
            "==": lhs == rhs, "!=": lhs != rhs}[kind]


def symbols(expr: Expr) -> set[str]:
    if expr[0] == "num":
        return set()
    if expr[0] == "sym":
        return {expr[1]}
    if expr[0] == "not":
        return symbols(expr[1])
    return symbols(expr[1]) | symbols(expr[2])


_PREC = {"or": -3, "and": -2, "not": -1, **dict.fromkeys(COMPARISONS, 0),
         "+": 1, "-": 1, "*": 2, "/": 2, "%": 2}


def unparse(expr: Expr, parent: int = -9, right: bool = False, *,
            spaced: bool = False) -> str:
    """The text of ``expr``, arithmetic tight (``N*C``) or, ``spaced``, as Python code is
    written (``N * C``: what an emitted kernel shows)."""
    kind = expr[0]
    if kind in ("num", "sym"):
        return str(expr[1])
    prec = _PREC[kind]
    if kind == "not":
        text = f"not {unparse(expr[1], prec, spaced=spaced)}"
    else:  # a comparison or and/or is spaced, as written
        op = f" {kind} " if prec <= 0 or spaced else kind
        text = (f"{unparse(expr[1], prec, spaced=spaced)}{op}"
                f"{unparse(expr[2], prec, True, spaced=spaced)}")
    return f"({text})" if prec < parent or (right and prec == parent) else text


def ragged_slot(combine: bool, world: Any, groups: Any, p: Any, j: Any,
                g: Any) -> tuple[Any, Any]:
    """ragged_all_to_all's slots with ``groups`` (DeepEP's low-latency layout), defined
    once, here, because the compiler and the runtime both import this leaf:
    ``(src slot, dst slot)`` of the rows sender p sends receiver j for group g, each the
    flat index of a slot of capacity rows (and of its count) in src/counts and in
    dst/recv_counts. A dispatch: src [W, G*C] (j, g), dst [G, W*C] (g, p); a combine the
    other way round. Plain arithmetic: on ints in the torch backend
    (dcpc.runtime.collectives) and the simulator (dcpc.ops.ragged_all_to_all ``_slots``),
    on the kernel's names where its ``lower`` renders the template's indices. G = 1:
    block j of src lands in block p of dst."""
    if combine:
        return g * world + j, p * groups + g
    return j * groups + g, g * world + p
