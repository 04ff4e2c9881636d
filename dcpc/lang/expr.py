"""Shape and size expressions: integers, symbols, + - * /, parentheses, a leading minus.

Parsed by a small recursive-descent parser into a tuple AST, never ``eval``ed:

    ("num", 4) | ("sym", "H") | (op, lhs, rhs) with op in "+-*/"

(a leading minus, ``-D``, is ``("-", ("num", 0), D)``: the AST has no unary node)

``/`` is exact division: evaluating it on values that do not divide raises
``InexactDivision``. The same AST is emitted into generated modules, where
``dcpc.runtime.shapes`` evaluates it without importing the compiler; the AST's
evaluation and printing are defined once, in ``dcpc.exprs``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

from dcpc.exprs import (  # noqa: F401  (the language's names for them)
    COMPARISONS,
    Expr,
    InexactDivision,
    UnboundSymbol,
    evaluate,
    holds,
    symbols,
    unparse,
)

# The language's limits on one expression (docs/language.md, "Limits"): checked before
# any parsing work, so no input reaches the parser's recursion, Python's 4,300-digit
# int limit or a huge number in a message.
MAX_TEXT = 512  # characters
MAX_DEPTH = 64  # nesting of parentheses, and of operators in the parsed tree
MAX_INT_DIGITS = 30  # digits of one integer: the YAML's own integers have the same bound

# The rank's name in an index (``o_parts[(r - h) % W]``: the slice of the rank's own
# block, dcpc.lang.loops) and in a shift's perm expression (dcpc.ops.shift); a hop
# index of the same name hides it
OWNER = "r"

# The builders the lowering rules view shapes with (dcpc/ops/<op>.py ``lower``)
W: Expr = ("sym", "W")
ONE: Expr = ("num", 1)

# ASCII digits and names only: str.isdigit and \d accept fullwidth and other Unicode
# digits, which int() would read as ASCII ones
_TOKEN = re.compile(r"[ \t\r\n]*(?:([0-9]+)|([A-Za-z_][A-Za-z0-9_]*)|(.))", re.S)
# a condition's operators besides a size expression's: '%' and the comparisons
_COND_OP = re.compile("|".join(re.escape(c) for c in (*COMPARISONS, "%")))
KEYWORDS = ("and", "or", "not")  # a condition's words: not names


class ExprSyntaxError(ValueError):
    """The text is not an expression; ``column`` is 0-based within the text."""

    def __init__(self, message: str, column: int):
        super().__init__(message)
        self.column = column


def _tokens(text: str, condition: bool = False, modulo: bool = False
            ) -> list[tuple[str, str | int, int]]:
    out: list[tuple[str, str | int, int]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m is not None
        if m.group(1):
            if len(m.group(1).lstrip("0")) > MAX_INT_DIGITS:
                raise ExprSyntaxError(f"an integer of more than {MAX_INT_DIGITS} digits",
                                      m.start(1))
            out.append(("num", int(m.group(1)), m.start(1)))
        elif m.group(2):
            out.append(("sym", m.group(2), m.start(2)))
        elif condition and _COND_OP.match(text, m.start(3)):
            op = _COND_OP.match(text, m.start(3))
            assert op is not None
            out.append(("op", op.group(0), m.start(3)))
            pos = op.end()
            continue
        else:
            ch = m.group(3)
            if ch not in "+-*/()" + ("%" if modulo else ""):
                raise ExprSyntaxError(f"unexpected character {ch!r}", m.start(3))
            out.append(("op", ch, m.start(3)))
        pos = m.end()
    out.append(("end", "", len(text)))
    return out


class _Parser:
    def __init__(self, text: str, condition: bool = False, modulo: bool = False):
        self.toks = _tokens(text, condition, modulo)
        self.condition = condition
        self.i = 0

    def peek(self) -> tuple[str, str | int, int]:
        return self.toks[self.i]

    def take(self) -> tuple[str, str | int, int]:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expr(self) -> Expr:  # expr := ["-"] term (("+"|"-") term)*
        # a leading minus negates the first atom (Python's precedence: -a * b, -a % W
        # read as (-a) * b, (-a) % W), as 0 - atom: one minus, only at the start of an
        # expression or after '(' ('- -D', '2 * -D' stay errors)
        negate = self.peek()[:2] == ("op", "-")
        if negate:
            self.take()
        node = self.term(negate)
        while self.peek()[:2] in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            node = (op, node, self.term())
        return node

    def term(self, negate: bool = False) -> Expr:  # term := atom (("*"|"/"|"%") atom)*,
        # '%' in a condition or a perm
        node = self.atom()
        if negate:
            node = ("-", ("num", 0), node)
        while self.peek()[:2] in (("op", "*"), ("op", "/"), ("op", "%")):
            op = self.take()[1]
            node = (op, node, self.atom())
        return node

    def atom(self) -> Expr:  # atom := int | symbol | "(" expr ")"
        kind, value, col = self.take()
        if kind == "sym" and self.condition and value in KEYWORDS:
            raise ExprSyntaxError(f"'{value}' joins conditions; here a number, a name or "
                                  "'(' is expected", col)
        if kind in ("num", "sym"):
            return (kind, value)
        if (kind, value) == ("op", "("):
            node = self.expr()
            kind, value, col = self.take()
            if (kind, value) != ("op", ")"):
                raise ExprSyntaxError("expected ')'", col)
            return node
        what = "end of expression" if kind == "end" else repr(value)
        raise ExprSyntaxError(f"expected a number, a size name or '(', found {what}", col)


    # a condition (a step's when:) := conj ("or" conj)*; conj := neg ("and" neg)*;
    # neg := "not" neg | "(" cond ")" | expr cmp expr, cmp one of < <= > >= == !=
    def cond(self) -> Expr:
        node = self.conj()
        while self.peek()[:2] == ("sym", "or"):
            self.take()
            node = ("or", node, self.conj())
        return node

    def conj(self) -> Expr:
        node = self.neg()
        while self.peek()[:2] == ("sym", "and"):
            self.take()
            node = ("and", node, self.neg())
        return node

    def neg(self) -> Expr:
        if self.peek()[:2] == ("sym", "not"):
            self.take()
            return ("not", self.neg())
        start = self.i
        if self.peek()[:2] == ("op", "("):
            try:  # '(h + 1) % 2 == 0' is a comparison, '(h < rank)' a condition
                return self.comparison()
            except ExprSyntaxError:
                self.i = start
            self.take()
            node = self.cond()
            kind, value, col = self.take()
            if (kind, value) != ("op", ")"):
                raise ExprSyntaxError("expected ')'", col)
            return node
        return self.comparison()

    def comparison(self) -> Expr:
        lhs = self.expr()
        kind, value, col = self.peek()
        if kind != "op" or value not in COMPARISONS:
            found = "the end" if kind == "end" else repr(value)
            raise ExprSyntaxError(
                f"expected a comparison (< <= > >= == !=), found {found}: a condition "
                "compares two expressions, e.g. 'h <= rank'", col)
        self.take()
        node = (value, lhs, self.expr())
        kind, value, col = self.peek()
        if kind == "op" and value in COMPARISONS:
            raise ExprSyntaxError("comparisons do not chain: write 'a < b and b < c'", col)
        return node


_KINDS = {bool: "a boolean", float: "a number with a fraction", type(None): "empty",
          list: "a list", dict: "a mapping"}


def parse(text: str | int, modulo: bool = False) -> Expr:
    """Parse an expression (an int is a constant), within the limits above. ``modulo``:
    ``%`` is an operator too (Python's remainder, as tight as ``*``): a shift's ``perm``
    (rank arithmetic, ``(r + W / 2) % W``); shapes, trip counts and indices stay without.

    Raises ``ExprSyntaxError`` (with a 0-based column) for every bad input: another
    type, too long, nested too deeply, an integer of too many digits, bad syntax.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        what = _KINDS.get(type(text), type(text).__name__)
        raise ExprSyntaxError(f"expected an integer or an expression, found {what}", 0)
    if isinstance(text, int):
        if text < 0:
            raise ExprSyntaxError("sizes cannot be negative", 0)
        if text >= 10**MAX_INT_DIGITS:
            raise ExprSyntaxError(f"an integer of more than {MAX_INT_DIGITS} digits", 0)
        return ("num", text)
    return _parse_text(text, bool(modulo))


@functools.lru_cache(maxsize=1024)
def _parse_text(text: str, modulo: bool) -> Expr:
    """``parse`` of a string, once per (text, modulo): a pure function whose result is an
    immutable tuple (a simulated call asks for a buffer's shape thousands of times); a
    bad text raises afresh each time (an exception is never cached)."""
    return _parse_within_limits(text, "expression", _Parser.expr, modulo=modulo)


def parse_condition(text: object) -> Expr:
    """Parse a condition (a step's ``when:``): comparisons of expressions (with ``%``)
    joined by ``and``, ``or``, ``not`` and parentheses, within the limits above.
    ``ExprSyntaxError`` (with a 0-based column) for every bad input."""
    if not isinstance(text, str):
        what = _KINDS.get(type(text), "a number" if isinstance(text, int)
                          else type(text).__name__)
        raise ExprSyntaxError(f"expected a condition such as 'h <= rank', found {what}", 0)
    return _parse_within_limits(text, "condition", _Parser.cond, condition=True)


def _parse_within_limits(text: str, what: str, rule: Callable[[_Parser], Expr],
                         condition: bool = False, modulo: bool = False) -> Expr:
    """Parse ``text`` as ``what`` ('expression' or 'condition') with ``rule`` (a
    ``_Parser`` method) within the limits every parsed text keeps: length, emptiness,
    nesting. The bounds are checked before the text is tokenized."""
    if len(text) > MAX_TEXT:
        raise ExprSyntaxError(f"the {what} is longer than {MAX_TEXT} characters", 0)
    if not text.strip():
        raise ExprSyntaxError(f"empty {what}", 0)
    _check_parentheses(text)
    parser = _Parser(text, condition=condition, modulo=modulo)
    node = rule(parser)
    kind, value, col = parser.peek()
    if kind != "end":
        raise ExprSyntaxError(f"unexpected {value!r} after a complete {what}", col)
    if _depth(node) > MAX_DEPTH:
        raise ExprSyntaxError(f"the {what} is nested deeper than {MAX_DEPTH}", 0)
    return node


def _check_parentheses(text: str) -> None:
    """Parentheses nest at most MAX_DEPTH deep (the parser's recursion stays shallow);
    the tree's depth alone misses '((((T))))', whose parentheses leave no node."""
    level = 0
    for column, char in enumerate(text):
        level += (char == "(") - (char == ")")
        if level > MAX_DEPTH:
            raise ExprSyntaxError(
                f"the expression's parentheses nest deeper than {MAX_DEPTH}", column)


def _depth(node: Expr) -> int:
    """Tree depth, computed without recursion."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if item[0] not in ("num", "sym"):
            stack += [(child, level + 1) for child in item[1:]]
    return deepest


def product(exprs: Iterable[Expr]) -> Expr:
    """The product of shape ASTs (constants folded, 1 when empty)."""
    const, syms = 1, []
    for e in exprs:
        if e[0] == "num":
            const *= e[1]
        else:
            syms.append(e)
    out: Expr | None = ("num", const) if const != 1 or not syms else None
    for e in syms:
        out = e if out is None else ("*", out, e)
    assert out is not None
    return out


def div(a: Expr, b: Expr) -> Expr:
    """``a / b``, exact (unevaluated)."""
    return ("/", a, b)
