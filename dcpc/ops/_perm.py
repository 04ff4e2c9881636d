"""A ``perm:`` (JAX's ``ppermute``): any fixed (partial) permutation of the ranks, as an
expression of ``r`` and ``W``, [source, destination] pairs or a destination per rank.
The one reading of that key for every op that names a peer by it: ``shift`` (the
destination of its push) and ``signal``/``wait`` (the peer a credit goes to, the peer
a wait polls). The unroller (dcpc.lang.loops) turns every form into the destination
table at the W it unrolls (``table_at``); every later stage sees that table (``table``);
who a rank receives from is dcpc.topology ``perm_sources``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dcpc.lang.expr import OWNER, Expr, evaluate, parse, symbols
from dcpc.lang.mesh import MAX_WORLD, mesh_of

if TYPE_CHECKING:
    from dcpc.lang.nodes import Step
    from dcpc.ops.iface import ShapeRules


class PermError(ValueError):
    """A ``perm`` that is no (partial) permutation at some W: the message says why."""


PERM_NAMES = frozenset({OWNER, "W"})
# the key under which the unroller keeps a signal's or wait's perm as written (their
# ``written``: the peer-mismatch message names it so, not the table at one W)
WRITTEN = "__perm__"


def table_at(value: Any, world: int, names: dict[str, int] | None = None) -> list[int]:
    """``perm`` (any written form) as the destination of each rank 0 .. W-1 at ``world``
    (-1: that rank sends nothing). ``names``: what else an expression may name (the hop
    indices of the enclosing loops, integer sizes). PermError when it is not one: a bad
    expression, a rank out of range, two sources onto one destination (``bad-perm``),
    or pairs / a table written for another W (``loop-world``, message starts "W:")."""
    if isinstance(value, str):
        env = {**(names or {}), "W": world}
        try:
            tree: Expr = parse(value, modulo=True)
        except ValueError as err:
            raise PermError(f"'{value}' is not an expression of {OWNER} and W: {err}") from err
        unknown = sorted(symbols(tree) - PERM_NAMES - set(env))
        if unknown:
            raise PermError(f"'{value}' names '{unknown[0]}'; a perm expression names the "
                            f"rank {OWNER}, the group size W, the hop indices of enclosing loops "
                            "and integer sizes only")
        out = []
        for r in range(world):
            try:
                d = evaluate(tree, {**env, OWNER: r})
            except ArithmeticError as err:
                raise PermError(f"'{value}' at W={world}, {OWNER}={r}: {err}") from err
            out.append(d if 0 <= d < world else -1)  # off the group: sends nothing
        return _injective(out, world, f"'{value}'")
    if not isinstance(value, list) or not value:
        raise PermError("a perm is an expression of r and W, a list of [source, "
                        "destination] pairs or a list of destinations, one per rank")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        table = list(value)
        if len(table) != world:
            raise PermError(f"W:the perm lists the destinations of {len(table)} ranks, so "
                            f"it is written for W={len(table)}, not W={world}")
        bad = [d for d in table if not -1 <= d < len(table)]
        if bad:
            raise PermError(f"destination {bad[0]} is not a rank of W={len(table)} (or -1: "
                            "sends nothing)")
        return _injective(table, world, "the perm")
    pairs = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in item)):
            raise PermError(f"{item!r} is not a [source, destination] pair of ranks")
        if max(item) >= MAX_WORLD:  # before a table of that many ranks is made
            raise PermError(f"rank {max(item)} is past the largest group dcpc checks "
                            f"({MAX_WORLD} ranks)")
        pairs.append((item[0], item[1]))
    fixed = fixed_world(value) or 1
    if fixed != world:
        raise PermError(f"W:the perm's pairs name ranks 0..{fixed - 1}, so it is written for "
                        f"W={fixed}, not W={world}")
    out = [-1] * world
    for src, dst in pairs:
        if out[src] != -1:
            raise PermError(f"rank {src} is the source of two pairs ({src} -> {out[src]}, "
                            f"{src} -> {dst}) at W={world}")
        out[src] = dst
    return _injective(out, world, "the perm")


def fixed_world(value: Any) -> int | None:
    """The W a perm written as a list fixes (a table's length, the largest rank of its
    pairs + 1), or None (an expression, or not a list of ranks: table_at says why)."""
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return len(value)
    ranks = [v for item in value if isinstance(item, list) for v in item
             if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return 1 + max(ranks) if ranks else None


def _injective(table: list[int], world: int, what: str) -> list[int]:
    seen: dict[int, int] = {}
    for r, d in enumerate(table):
        if d < 0:
            continue
        if d in seen:
            raise PermError(f"{what} sends ranks {seen[d]} and {r} both to rank {d} at "
                            f"W={world}; a perm is one-to-one")
        seen[d] = r
    return table


_WHY = {"offset": " (a perm of 'r + k' is the offset k)",
        "wrap": " (a value outside 0 .. W-1 sends nothing)"}


def table(op: Any) -> tuple[int, ...]:
    """The unrolled perm of ``op``: the destination of each rank (-1: none); () for
    none (or one not unrolled yet)."""
    value = getattr(op, "perm", None)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return ()


def perm_shape(schedule: Any, dests: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The shape a perm's table over ranks was unrolled for: a mesh's (its ints, else
    the one the unroller served), else the one axis of the table's W."""
    mesh = mesh_of(schedule)
    if len(mesh.axes) < 2:
        return (len(dests),)
    served = getattr(schedule, "loop_world", None)
    return tuple(int(s) for s in (served if isinstance(served, tuple) else mesh.sizes))


def verify_perm(v: ShapeRules, step: Step, given: list[str]) -> bool:
    """``bad-perm`` where ``step``'s op has a ``perm`` next to the keys ``given`` (those
    that name a peer otherwise, written: a perm names every rank's peer itself) or one
    that was not unrolled at a W. True when it has a perm and no error."""
    op = step.op
    if getattr(op, "perm", None) is None:
        return False
    if given:
        v.error(op.mark(given[0]), "bad-perm",
                f"step '{step.name}' has both 'perm' and '{given[0]}'; a perm names every "
                "rank's peer itself",
                " and ".join(f"drop '{k}'" + _WHY.get(k, "") for k in given))
        return False
    if not table(op):
        v.error(op.mark("perm"), "bad-perm",
                f"step '{step.name}' has a perm that was not unrolled at a W",
                "check or compile with --world N")
        return False
    return True
