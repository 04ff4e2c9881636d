"""Mesh axes and teams: the one place every stage asks "which ranks does this op talk to".

A schedule's ``mesh: {node: N, gpu: G}`` names its axes, outermost first; each value is
a size name or an integer. Without ``mesh:`` the schedule has one axis, ``world``, of
size ``W``. A rank is a coordinate tuple; its linear index is row-major (last axis
fastest): ``rank = node * G + gpu``. W is the product of the axis sizes.

A communication op's ``axis:`` (a name or a list; default: every axis) picks its
**team**: the ranks that share every coordinate off those axes. ``G``, the team size,
replaces W in the op's shape rules; ``next``/``prev`` move one coordinate by one, mod
its size (a team of one axis only).

A group size for a mesh schedule is a ``MeshWorld``: an ``int`` (W, so every stage that
does arithmetic with W keeps working) that also carries the axis sizes, printed
``2x4``. A plain schedule keeps plain ints.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcpc.lang.nodes import ScheduleView

from dcpc.topology import (  # noqa: F401  (re-exported: the compiler's names for them)
    Axes,
    MeshWorld,
    Torus,
    grown,
    rank_text,
    shape_of,
    torus,
)

DEFAULT_AXIS = "world"
MAX_WORLD = 1024  # the largest group size dcpc checks (ranks of a mesh shape)
DEFAULT_WORLDS: tuple[int, ...] = tuple(range(2, 9))  # what check and compile prove without --world
MAX_AXES = 4  # axes of a mesh: the default shapes (2..4 per axis) stay within the work limit


@dataclass(frozen=True)
class Mesh:
    """A schedule's axes (outermost first) and what sizes them (a size name or an int)."""

    axes: tuple[str, ...]
    sizes: tuple[str | int, ...]
    declared: bool  # written as ``mesh:`` (else the implicit one axis ``world``)

    def position(self, name: str) -> int | None:
        return self.axes.index(name) if name in self.axes else None

    def size_names(self) -> dict[str, int]:
        """Size name -> axis position, for the axes sized by a name."""
        return {s: i for i, s in enumerate(self.sizes) if isinstance(s, str)}

    def team_axes(self, op: Any) -> Axes | None:
        """The positions of an op's ``axis:`` names; None for every axis (the default,
        or a list naming every axis). Unknown names are the structural checker's error
        (they are left out here; naming none but them reads as every axis)."""
        value = getattr(op, "axis", None)
        if value is None:
            return None
        named = [value] if isinstance(value, str) else list(value)
        found = tuple(sorted({p for n in named if (p := self.position(n)) is not None}))
        every = tuple(range(len(self.axes)))
        return None if found in (every, ()) else found  # () only names unknown axes

    def team_size(self, op: Any) -> tuple:
        """The size of ``op``'s team as a shape expression (dcpc.lang.expr): ``W`` for
        every axis, else the product of its axes' sizes (``G``, ``N*G``). What replaces
        W in the op's shape rules (check) and part sizes (codegen)."""
        axes = self.team_axes(op)
        if axes is None:
            return ("sym", "W")
        out: tuple | None = None
        for a in axes:
            size = self.sizes[a]
            node = ("sym", size) if isinstance(size, str) else ("num", size)
            out = node if out is None else ("*", out, node)
        assert out is not None
        return out

    def names(self, axes: Axes | None) -> tuple[str, ...]:
        return self.axes if axes is None else tuple(self.axes[a] for a in axes)

    def world(self, shape: Sequence[int]) -> int:
        """The group size of a shape: a plain int for the implicit one axis."""
        return int(shape[0]) if not self.declared else MeshWorld(shape)


def mesh_of(schedule: ScheduleView) -> Mesh:
    """The mesh of a schedule (the implicit ``world: W`` without ``mesh:``)."""
    declared = getattr(schedule, "mesh", None)
    if not declared:
        return Mesh((DEFAULT_AXIS,), ("W",), False)
    return Mesh(tuple(declared), tuple(declared.values()), True)


# --- group sizes: --world text, and fitting them to a schedule ---------------------


class WorldError(ValueError):
    """A ``--world`` text, or a group size that does not fit the schedule's mesh."""


_COUNT = re.compile(r"[0-9]{1,9}")  # ASCII digits only (int() reads '２' and '1_0')


def parse_count(text: str) -> int:
    """One group or axis size of ``--world``: ASCII digits (at most 9); ``WorldError``
    otherwise."""
    if not _COUNT.fullmatch(text.strip()):
        raise WorldError(f"'{text.strip()}' is not a group size (digits 0-9)")
    return int(text)


def _bounds(part: str) -> tuple[int, int]:
    first, sep, last = part.partition("..")
    try:
        return parse_count(first), parse_count(last if sep else first)
    except WorldError:
        raise WorldError(f"'{part}' is not a group size or range (e.g. 4 or 2..8)") from None


def parse_range(text: str, limit: int) -> list[int]:
    """``4``, ``2..8`` or ``2,4,8`` -> the sizes, each in 1..limit."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, hi = _bounds(part)
        if lo < 1 or hi < lo:
            raise WorldError(f"'{part}' is not a range of positive sizes (e.g. 2..8)")
        if hi > limit:
            raise WorldError(f"{hi} is above the largest group size {limit}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_shapes(text: str, limit: int) -> list[MeshWorld]:
    """``2x4`` or ``2..4x8`` (one range per axis, outermost first) -> mesh shapes, each
    of 2..``limit`` ranks. The axes and the extreme shapes are checked before the
    shapes are listed (there are then at most ``limit`` of them)."""
    parts = text.split("x")
    if len(parts) > MAX_AXES:
        raise WorldError(f"a mesh shape has at most {MAX_AXES} axes, not {len(parts)}")
    axes = [parse_range(part, limit) for part in parts]
    largest = MeshWorld(tuple(a[-1] for a in axes))
    if int(largest) > limit:
        raise WorldError(f"mesh {largest} has {int(largest)} ranks, above the largest group "
                         f"size {limit}")
    smallest = MeshWorld(tuple(a[0] for a in axes))
    if int(smallest) < 2:
        raise WorldError(f"mesh {smallest} has {int(smallest)} rank; a group has 2 to {limit} "
                         "ranks (start an axis at 2)")
    return sorted({MeshWorld(s) for s in itertools.product(*axes)})


def default_shapes(mesh: Mesh, maxima: dict[str, int]) -> list[MeshWorld]:
    """The shapes checked when ``--world`` is not given, for a mesh of several axes: each
    axis sized by a name in 2..4 (at most its ``max``), an int axis its size."""
    if len(mesh.axes) > MAX_AXES:  # refused as bad-mesh: no 3**axes shapes listed first
        raise WorldError(f"a mesh has at most {MAX_AXES} axes, not {len(mesh.axes)}")
    pools = [[size] if isinstance(size, int) else
             [v for v in (2, 3, 4) if v <= maxima.get(size, 4)] or [maxima[size]]
             for size in mesh.sizes]
    return sorted(MeshWorld(shape) for shape in itertools.product(*pools))


def fit_worlds(mesh: Mesh, worlds: Iterable[int]) -> list[int]:
    """The group sizes as the schedule's mesh reads them: a plain W for a schedule of
    one axis (its mesh's or the implicit one), a shape of as many axes as its mesh.
    Raises ``WorldError`` for a plain W given to a mesh of several axes, or a shape
    given to a schedule without that many axes."""
    out: list[int] = []
    for w in worlds:
        shape = shape_of(w)
        if isinstance(w, MeshWorld) and not mesh.declared and len(shape) > 1:
            raise WorldError(f"--world {w} is a mesh shape, but the schedule declares no "
                             "'mesh:' (one axis, W): give a group size such as 4")
        if len(shape) != len(mesh.axes):
            axes = " x ".join(mesh.axes)
            raise WorldError(f"group size {w} has {len(shape)} axis(es), but the schedule's "
                             f"mesh has {len(mesh.axes)} ({axes}): give a shape such as "
                             + "x".join("2" for _ in mesh.axes))
        for axis, size, value in zip(mesh.axes, mesh.sizes, shape, strict=True):
            if isinstance(size, int) and size >= 1 and mesh.declared and value != size:
                raise WorldError(f"group size {w} gives axis '{axis}' {value} ranks, but the "
                                 f"mesh fixes it at {size}")
        out.append(mesh.world(shape))
    return out


def _runs(values: Sequence[int]) -> str:
    """Sorted distinct ints in ``--world`` syntax: [2, 3, 4, 8] -> '2..4,8'."""
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def worlds_text(worlds: Sequence[int]) -> str:
    """Exactly the group sizes checked, in ``--world`` syntax (``parse_worlds`` reads it
    back to the same list): '2..8', '4,8', '2..4x2..4', '2x2,2x4'."""
    shapes = sorted({w.shape for w in worlds if isinstance(w, MeshWorld)})
    if not shapes:
        return _runs(sorted({int(w) for w in worlds}))
    axes = [sorted({s[i] for s in shapes}) for i in range(len(shapes[0]))]
    whole = all(len(s) == len(axes) for s in shapes) and len(shapes) == _product(axes)
    if whole and all(a[-1] - a[0] == len(a) - 1 for a in axes):  # a box of ranges
        return "x".join(_runs(a) for a in axes)
    return ",".join("x".join(map(str, s)) for s in shapes)


def _product(axes: Sequence[Sequence[int]]) -> int:
    out = 1
    for a in axes:
        out *= len(a)
    return out
