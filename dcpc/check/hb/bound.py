"""The world bound: past it one group size (one axis size on a mesh) stands for every
larger one, so the checker analyses only representatives (docs/hb-checker.md, "Why one W
stands for every W past the world bound").

Apart from the checker because dcpc.check.structural prices the checker's work with the
same arithmetic (``hb_cost``) before the checker runs, and the checker's hints re-run
structural: both import this module, it imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcpc.lang.mesh import MeshWorld, shape_of
from dcpc.ops.common import ring_hops

if TYPE_CHECKING:
    from dcpc.check.hb.events import Program


def world_bound(program: Program, calls: int | None = None) -> int:
    """Every W above this bound has exactly the findings of the bound plus one.

    Why: every peer pattern is a rank offset (``all``, ``next``, ``prev``), so by
    rotation symmetry a finding is a relation between ranks at some offset d. A
    happens-before chain moves by one rank per ``next``/``prev`` wait it passes (k
    ranks per wait of a shift by offset k, counted k times) and to
    every rank at once through an ``all`` one; in the unroll window there are at most
    K = (next/prev waits per call) x calls such hops. For W > 2K + 2 no chain wraps
    around the ring, offsets |d| <= K relate ranks exactly as at any other such W,
    and all larger offsets are alike (only ``all`` waits reach them), and exist; the
    regions' overlap rules do not depend on W, and neither does wait matching once
    ``next`` and ``prev`` differ (W >= 3). Below the bound every W is analysed.
    tests/check/test_hb_unroll.py compares this with analysing every W.
    """
    per_call = sum(ring_hops(e.wait[1]) for e in program.events if e.wait is not None)
    return bound_for(per_call, calls or program.default_calls())


def axis_bounds(program: Program, calls: int | None = None) -> list[int]:
    """The world bound of each mesh axis (docs/hb-checker.md, "Meshes"): the bound of
    ``world_bound`` for the next/prev waits along that axis. An axis longer than its
    bound stands for every longer one, whatever the other axes are."""
    count = calls or program.default_calls()
    out = []
    for a in range(len(program.axis_names)):
        along = sum(ring_hops(e.wait[1]) for e in program.events if e.wait is not None
                    and (e.axes if e.axes is not None else tuple(range(len(program.axis_names))))
                    == (a,))
        out.append(bound_for(along, count))
    return out


def mesh_representatives(worlds: list[int], bounds: list[int]) -> list[int]:
    """The mesh shapes to analyse: each axis size above its bound replaced by the
    smallest size asked above it on that axis (one stands for all), deduplicated."""
    shapes = [shape_of(w) for w in worlds]
    above = [min((s[a] for s in shapes if s[a] > b), default=0) for a, b in enumerate(bounds)]
    picked = {MeshWorld(tuple(above[a] if x > bounds[a] else x for a, x in enumerate(s)))
              for s in shapes}
    return sorted(picked)


def bound_for(ring_waits: int, calls: int) -> int:
    """The world bound of ``world_bound`` for ``ring_waits`` next/prev waits per call
    and ``calls`` unrolled calls per rank."""
    return max(8, 2 * ring_waits * calls + 3)


def representatives(worlds: list[int], bound: int) -> list[int]:
    """The group sizes to analyse: every one up to ``bound``, then the first and the
    last above it (any one would do; the last keeps the largest W's stats)."""
    above = [w for w in worlds if w > bound]
    return [w for w in worlds if w <= bound] + sorted({above[0], above[-1]} if above else set())
