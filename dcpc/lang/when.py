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

from collections.abc import Mapping
from typing import Any

from dcpc.lang import expr as ex
from dcpc.lang.mesh import mesh_of
from dcpc.topology import shape_of, torus

RANK = "rank"


def condition(step: Any) -> ex.Expr | None:
    """The parsed ``when:`` of a step (None: it runs on every rank); a bad one raises
    ``ExprSyntaxError`` (the checker reports it first, located)."""
    text = getattr(step.op, "when", None)
    return None if text is None else ex.parse_condition(text)


def int_sizes(schedule: Any) -> dict[str, int]:
    """The sizes declared as plain integers."""
    return {k: v for k, v in schedule.sizes.items()
            if isinstance(v, int) and not isinstance(v, bool)}


def names(schedule: Any) -> set[str]:
    """Every name a condition may use (its hop indices are values by now)."""
    mesh = mesh_of(schedule)
    out = {RANK, "W", *int_sizes(schedule), *mesh.size_names()}
    return out | (set(mesh.axes) if mesh.declared else set())


def env(schedule: Any, rank: int, world: int,
        sizes: Mapping[str, int] | None = None) -> dict[str, int]:
    """What a condition reads on ``rank`` of a group of ``world`` ranks (a mesh shape:
    dcpc.topology): rank, W, the integer sizes (``sizes``: these instead) and, on a
    mesh, each axis' coordinate and size."""
    out = dict(int_sizes(schedule) if sizes is None else sizes)
    out.update({RANK: rank, "W": int(world)})
    mesh = mesh_of(schedule)
    shape = shape_of(world)
    if mesh.declared and len(shape) == len(mesh.axes):
        coords = torus(shape).coords(rank)
        out.update(zip(mesh.axes, coords, strict=True))
        out.update({name: shape[at] for name, at in mesh.size_names().items()})
    return out


def runs(schedule: Any, step: Any, rank: int, world: int) -> bool:
    """Whether ``step`` runs on ``rank`` at ``world``."""
    cond = condition(step)
    return cond is None or ex.holds(cond, env(schedule, rank, world))
