"""Rank-dependent steps: a step's ``when:`` condition, and where it holds.

    - attend_lower: {op: external, when: "h + 1 <= rank", reads: [...], writes: [...]}

The condition (dcpc.lang.expr ``parse_condition``) names ``rank`` (the rank's index in
the group), W, the integer sizes, the hop indices of the loops around the step (the
unroller puts their values in: dcpc.lang.loops) and, on a mesh, each axis' name (the
rank's coordinate along it) and the axes' size names. Only a step that runs on its
rank alone (its op's semantics: no signal, no wait, no store into another rank) may
carry one (dcpc.check.when), so every signal and wait still runs on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from dcpc.lang import expr as ex
from dcpc.lang.mesh import mesh_of
from dcpc.lang.nodes import int_sizes
from dcpc.topology import shape_of, torus

RANK = "rank"
# the marks key of a guard the unroller made from an index that names the rank
# (dcpc.lang.expr.OWNER): where that index is, for the checker's messages
OWNER_MARK = "owner-index"


# the rank-by-rank work of one check: (guarded steps) x (ranks of every W checked) is
# bounded (docs/language.md, "Limits"): past it the check is refused at once
# (schedule-too-large) instead of taking seconds
MAX_RANK_CHECKS = 200_000


@lru_cache(maxsize=4096)
def _parsed(text: str) -> ex.Expr:
    return ex.parse_condition(text)


def condition(step: Any) -> ex.Expr | None:
    """The parsed ``when:`` of a step (None: it runs on every rank); a bad one raises
    ``ExprSyntaxError`` (the checker reports it first, located)."""
    text = getattr(step.op, "when", None)
    return None if text is None else _parsed(text)


def guarded(schedule: Any) -> list[Any]:
    """The steps with a ``when:``."""
    return [s for s in schedule.step_list() if getattr(s.op, "when", None) is not None]


def rank_checks(schedule: Any, worlds: Iterable[int]) -> int:
    """How many (guarded step, rank) pairs a check of ``worlds`` decides."""
    return len(guarded(schedule)) * sum(int(w) for w in worlds)


def names(schedule: Any) -> set[str]:
    """Every name a condition may use (its hop indices are values by now)."""
    mesh = mesh_of(schedule)
    out = {RANK, "W", *int_sizes(schedule), *mesh.size_names()}
    return out | (set(mesh.axes) if mesh.declared else set())


def envs(schedule: Any, world: int) -> list[dict[str, int]]:
    """What a condition reads on each rank of a group of ``world`` ranks (a mesh shape:
    dcpc.topology): rank, W, the integer sizes and, on a mesh, each axis' coordinate
    and size."""
    base = int_sizes(schedule)
    base["W"] = int(world)
    mesh = mesh_of(schedule)
    shape = shape_of(world)
    on_mesh = mesh.declared and len(shape) == len(mesh.axes)
    if on_mesh:
        base.update({name: shape[at] for name, at in mesh.size_names().items()})
    out = []
    for rank in range(int(world)):
        one = {**base, RANK: rank}
        if on_mesh:
            one.update(zip(mesh.axes, torus(shape).coords(rank), strict=True))
        out.append(one)
    return out


def env(schedule: Any, rank: int, world: int) -> dict[str, int]:
    """What a condition reads on ``rank`` (``envs``)."""
    return envs(schedule, world)[rank]


def running(schedule: Any, world: int) -> dict[int, frozenset[int]]:
    """Step index -> the ranks it runs on at ``world``, for every guarded step; a
    condition that has no value on some rank (dcpc.check.when reports it) counts as
    holding there (more accesses: sound)."""
    out: dict[int, frozenset[int]] = {}
    steps = guarded(schedule)
    if not steps:
        return out
    every = envs(schedule, world)
    for step in steps:
        try:
            cond = condition(step)
        except ex.ExprSyntaxError:
            out[step.index] = frozenset(range(int(world)))
            continue
        assert cond is not None
        out[step.index] = frozenset(r for r, e in enumerate(every) if _holds(cond, e))
    return out


def _holds(cond: ex.Expr, env: Mapping[str, int]) -> bool:
    try:
        return ex.holds(cond, env)
    except (ArithmeticError, ValueError, KeyError):
        return True


def runs(schedule: Any, step: Any, rank: int, world: int) -> bool:
    """Whether ``step`` runs on ``rank`` at ``world``."""
    cond = condition(step)
    return cond is None or _holds(cond, env(schedule, rank, world))
