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
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcpc.lang.model import Schedule

DEFAULT_AXIS = "world"
Axes = tuple[int, ...]  # positions of a team's axes in the mesh, in mesh order


class MeshWorld(int):
    """A group size with its axis sizes: ``int(w)`` is W, ``w.shape`` the sizes."""

    shape: tuple[int, ...]

    def __new__(cls, shape: Sequence[int]) -> MeshWorld:
        value = super().__new__(cls, math.prod(shape))
        value.shape = tuple(int(s) for s in shape)
        return value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MeshWorld):
            return self.shape == other.shape
        return NotImplemented if not isinstance(other, int) else False

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("mesh", self.shape))

    def __lt__(self, other: object) -> bool:  # W first, then the shape (sorting)
        if isinstance(other, MeshWorld):
            return (int(self), self.shape) < (int(other), other.shape)
        return int(self) < other  # type: ignore[operator]

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __reduce__(self) -> tuple[Any, ...]:
        return (MeshWorld, (self.shape,))


def grown(world: int) -> int:
    """The next group size: W + 1, or a mesh with its innermost axis one longer."""
    if isinstance(world, MeshWorld):
        return MeshWorld((*world.shape[:-1], world.shape[-1] + 1))
    return world + 1


def shape_of(world: int) -> tuple[int, ...]:
    """The axis sizes of a group size (one axis for a plain int)."""
    return world.shape if isinstance(world, MeshWorld) else (int(world),)


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

    def names(self, axes: Axes | None) -> tuple[str, ...]:
        return self.axes if axes is None else tuple(self.axes[a] for a in axes)

    def world(self, shape: Sequence[int]) -> int:
        """The group size of a shape: a plain int for the implicit one axis."""
        return int(shape[0]) if not self.declared else MeshWorld(shape)


def mesh_of(schedule: Schedule) -> Mesh:
    """The mesh of a schedule (the implicit ``world: W`` without ``mesh:``)."""
    declared = getattr(schedule, "mesh", None)
    if not declared:
        return Mesh((DEFAULT_AXIS,), ("W",), False)
    return Mesh(tuple(declared), tuple(declared.values()), True)


@dataclass(frozen=True)
class Torus:
    """The ranks of one group size as a torus: coordinates, teams, peers and
    translations (the group the happens-before checker's symmetry uses)."""

    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        out, step = [], 1
        for s in reversed(self.shape):
            out.append(step)
            step *= s
        return tuple(reversed(out))

    def coords(self, rank: int) -> tuple[int, ...]:
        return tuple((rank // st) % s for st, s in zip(self.strides, self.shape, strict=True))

    def index(self, coords: Iterable[int]) -> int:
        return sum((c % s) * st for c, s, st in zip(coords, self.shape, self.strides,
                                                     strict=True))

    def add(self, a: int, b: int) -> int:
        if len(self.shape) == 1:
            return (a + b) % self.shape[0]
        return self.index(x + y for x, y in zip(self.coords(a), self.coords(b), strict=True))

    def sub(self, a: int, b: int) -> int:
        if len(self.shape) == 1:
            return (a - b) % self.shape[0]
        return self.index(x - y for x, y in zip(self.coords(a), self.coords(b), strict=True))

    def neg(self, a: int) -> int:
        return self.sub(0, a)

    def axes(self, axes: Axes | None) -> Axes:
        return tuple(range(len(self.shape))) if axes is None else axes

    def team(self, rank: int, axes: Axes | None) -> list[int]:
        """The ranks of ``rank``'s team along ``axes``, in member order (row-major over
        the team's axes)."""
        along = self.axes(axes)
        base = list(self.coords(rank))
        out = []
        for values in itertools.product(*(range(self.shape[a]) for a in along)):
            for a, v in zip(along, values, strict=True):
                base[a] = v
            out.append(self.index(base))
        return out

    def member(self, rank: int, axes: Axes | None) -> int:
        """``rank``'s index in its team along ``axes``."""
        c, index = self.coords(rank), 0
        for a in self.axes(axes):
            index = index * self.shape[a] + c[a]
        return index

    def team_size(self, axes: Axes | None) -> int:
        return math.prod(self.shape[a] for a in self.axes(axes))

    def deltas(self, peers: str, axes: Axes | None) -> frozenset[int]:
        """The translations (as ranks: the peer of rank 0) that ``all``/``next``/``prev``
        along ``axes`` name; never 0. next/prev need a team of one axis."""
        return _deltas(self.shape, peers, axes)

    def shift(self, d: int) -> list[int]:
        """perm[q] = q - d: row q of a clock translated by d reads row perm[q]."""
        return _shift(self.shape, d)

    def name(self, rank: int, axis_names: Sequence[str]) -> str:
        """``(node=1, gpu=0)``."""
        return "(" + ", ".join(f"{n}={c}" for n, c in zip(axis_names, self.coords(rank),
                                                           strict=True)) + ")"


@cache
def torus(shape: tuple[int, ...]) -> Torus:
    return Torus(shape)


@cache
def _deltas(shape: tuple[int, ...], peers: str, axes: Axes | None) -> frozenset[int]:
    t = Torus(shape)
    if peers == "all":
        return frozenset(r for r in t.team(0, axes) if r != 0)
    along = t.axes(axes)
    assert len(along) == 1, "next/prev need a team of one axis"
    a = along[0]
    step = 1 if peers == "next" else shape[a] - 1
    delta = (step % shape[a]) * t.strides[a]
    return frozenset({delta}) if delta else frozenset()


@cache
def _shift(shape: tuple[int, ...], d: int) -> list[int]:
    t = Torus(shape)
    return [t.sub(q, d) for q in range(t.size)]


def rank_text(world: int, rank: int, axis_names: Sequence[str] | None = None) -> str:
    """How a counterexample names a rank: ``rank 3``, or ``rank (node=1, gpu=0)``."""
    if not isinstance(world, MeshWorld):
        return f"rank {rank}"
    names = axis_names or [f"a{i}" for i in range(len(world.shape))]
    return "rank " + torus(world.shape).name(rank, names)


# --- group sizes: --world text, and fitting them to a schedule ---------------------


class WorldError(ValueError):
    """A ``--world`` text, or a group size that does not fit the schedule's mesh."""


def parse_range(text: str, limit: int) -> list[int]:
    """``4``, ``2..8`` or ``2,4,8`` -> the sizes, each in 1..limit."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, sep, last = part.partition("..")
        try:
            lo, hi = int(first), int(last if sep else first)
        except ValueError:
            raise WorldError(f"'{part}' is not a group size or range (e.g. 4 or 2..8)") from None
        if lo < 1 or hi < lo:
            raise WorldError(f"'{part}' is not a range of positive sizes (e.g. 2..8)")
        if hi > limit:
            raise WorldError(f"{hi} is above the largest group size {limit}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_shapes(text: str, limit: int) -> list[MeshWorld]:
    """``2x4`` or ``2..4x8`` (one range per axis, outermost first) -> mesh shapes."""
    axes = [parse_range(part, limit) for part in text.split("x")]
    out = sorted({MeshWorld(s) for s in itertools.product(*axes)})
    too_big = [w for w in out if int(w) > limit]
    if too_big:
        raise WorldError(f"mesh {too_big[0]} has {int(too_big[0])} ranks, above the largest "
                         f"group size {limit}")
    return out


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
        out.append(mesh.world(shape))
    return out
