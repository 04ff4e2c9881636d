"""Ranks as a torus: mesh shapes, coordinates, teams, peers and translations.

The one definition of "which ranks does a team op talk to", shared by the compiler
(dcpc.lang.mesh reads a schedule's ``mesh:`` and re-exports these) and the generated
modules' runtime (dcpc.runtime.teams), which imports nothing of the compiler. Ranks
are row-major (last axis fastest); a team along some axes is the ranks that share
every other coordinate, in row-major order over its axes (member order).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

# the buffer a rotation of the rank names (dcpc.lang.loops' ``_Unroller._rotated``): slot
# (r + c) mod W of buffer b on rank r; ``rotations`` reads the names back (the module's
# header, ScheduleModule.buffer's message)
ROTATION = "{}_rot{}"
Axes = tuple[int, ...]  # positions of a team's axes in the mesh, in mesh order


class MeshWorld(int):
    """A group size with its axis sizes: ``int(w)`` is W, ``w.shape`` the sizes."""

    shape: tuple[int, ...]

    def __new__(cls, shape: Sequence[int]) -> MeshWorld:
        value = super().__new__(cls, math.prod(shape))
        value.shape = tuple(int(s) for s in shape)
        return value

    def __eq__(self, other: object) -> bool:
        """Two shapes are equal when their axis sizes are; against a plain int a shape
        is its W (so shapes, dims and sizes computed from W compare as numbers)."""
        if isinstance(other, MeshWorld):
            return self.shape == other.shape
        return int(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return int.__hash__(self)  # equal to W's hash: 2x2 and 4x1 differ, but share it

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
class Torus:
    """The ranks of one group size as a torus: coordinates, teams, peers and
    translations (the group the happens-before checker's symmetry uses)."""

    shape: tuple[int, ...]

    # The happens-before checker asks coordinates, differences and teams millions of
    # times on a mesh: each is a table lookup or a few additions (cached per shape, as
    # ``torus()`` caches the object), not a coordinate round trip (issue 31).

    @cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def strides(self) -> tuple[int, ...]:
        out, step = [], 1
        for s in reversed(self.shape):
            out.append(step)
            step *= s
        return tuple(reversed(out))

    @cached_property
    def _coords(self) -> list[tuple[int, ...]]:
        """Every rank's coordinates: row-major, the last axis fastest."""
        return list(itertools.product(*(range(s) for s in self.shape)))

    def coords(self, rank: int) -> tuple[int, ...]:
        if 0 <= rank < self.size:
            return self._coords[rank]
        return tuple((rank // st) % s for st, s in zip(self.strides, self.shape, strict=True))

    def index(self, coords: Iterable[int]) -> int:
        return sum((c % s) * st for c, s, st in zip(coords, self.shape, self.strides,
                                                     strict=True))

    def add(self, a: int, b: int) -> int:
        if len(self.shape) == 1:
            return (a + b) % self.shape[0]
        out = 0
        for x, y, s, st in zip(self.coords(a), self.coords(b), self.shape, self.strides,
                               strict=True):
            out += (x + y) % s * st
        return out

    def sub(self, a: int, b: int) -> int:
        if len(self.shape) == 1:
            return (a - b) % self.shape[0]
        out = 0
        for x, y, s, st in zip(self.coords(a), self.coords(b), self.shape, self.strides,
                               strict=True):
            out += (x - y) % s * st
        return out

    def neg(self, a: int) -> int:
        return self.sub(0, a)

    def axes(self, axes: Axes | None) -> Axes:
        return tuple(range(len(self.shape))) if axes is None else axes

    def team(self, rank: int, axes: Axes | None) -> list[int]:
        """The ranks of ``rank``'s team along ``axes``, in member order (row-major over
        the team's axes): the rank with its team coordinates zeroed, plus each offset."""
        along = self.axes(axes)
        c = self.coords(rank)
        base = self.index(c) - sum(c[a] * self.strides[a] for a in along)
        return [base + o for o in self._offsets(along)]

    def _offsets(self, along: Axes) -> list[int]:
        """The rank offsets of a team along ``along`` from its member 0, member order."""
        cache = self.__dict__.setdefault("_team_offsets", {})
        if along not in cache:
            out = [0]
            for a in along:
                out = [o + v * self.strides[a] for o in out for v in range(self.shape[a])]
            cache[along] = out
        return cache[along]

    def member(self, rank: int, axes: Axes | None) -> int:
        """``rank``'s index in its team along ``axes``."""
        c, index = self.coords(rank), 0
        for a in self.axes(axes):
            index = index * self.shape[a] + c[a]
        return index

    def team_size(self, axes: Axes | None) -> int:
        return math.prod(self.shape[a] for a in self.axes(axes))

    def peer(self, rank: int, axes: Axes | None, k: int, wrap: bool = True) -> int | None:
        """The rank at member index ``member(rank) + k`` of ``rank``'s team along ``axes``
        (mod the team size; ``wrap`` False: None past either end): next/prev (k = +-1)
        and a shift's offset along a team, one definition for every stage."""
        team = self.team(rank, axes)
        found = along(self.member(rank, axes), len(team), k, wrap)
        return None if found is None else team[found]

    def perm_ranks(self, members: Sequence[int], axes: Axes | None) -> tuple[int, ...]:
        """A perm along ``axes`` as ranks: ``members`` names the destination of each
        member index of a team (-1: none; JAX's ``ppermute`` over an axis name), the
        same on every team; the result is the destination rank of each rank (-1:
        none). The one mapping member index -> rank of a perm (``team_table`` inverts
        it for one team)."""
        out = []
        for rank in range(self.size):
            d = members[self.member(rank, axes)]
            out.append(self.team(rank, axes)[d] if d >= 0 else -1)
        return tuple(out)

    def deltas(self, peers: str, axes: Axes | None) -> frozenset[int]:
        """The translations (as ranks: the peer of rank 0) that ``all``/``next``/``prev``
        (or a shift's "+k", cyclic) along ``axes`` name; never 0. next/prev and a shift
        need a team of one axis."""
        return _deltas(self.shape, peers, axes)

    def shift(self, d: int) -> list[int]:
        """perm[q] = q - d: row q of a clock translated by d reads row perm[q]."""
        return _shift(self.shape, d)

    def name(self, rank: int, axis_names: Sequence[str]) -> str:
        """``(node=1, gpu=0)``."""
        return "(" + ", ".join(f"{n}={c}" for n, c in zip(axis_names, self.coords(rank),
                                                           strict=True)) + ")"


def along(member: int, size: int, k: int, wrap: bool = True) -> int | None:
    """Member ``member + k`` of a team of ``size`` members: mod ``size`` on a ring, None
    past either end where ``wrap`` is False (a line: a shift with ``wrap: false``). The
    one definition of a shift's peer by offset: over ranks through ``Torus.peer``, over
    member indices in the float64 reference and the torch backend."""
    if not wrap and not 0 <= member + k < size:
        return None
    return (member + k) % size


def perm_sources(dests: Sequence[int]) -> tuple[int, ...]:
    """The source of each member of a perm's destination table (-1: none, as in
    ``dests``): the one inverse of a perm (who a member receives from)."""
    out = [-1] * len(dests)
    for r, d in enumerate(dests):
        if d >= 0:
            out[d] = r
    return tuple(out)


def team_table(ranks: Sequence[int], team: Sequence[int]) -> list[int]:
    """A perm's destination table over ranks (``Torus.perm_ranks``) read by one team
    (its global ranks in member order): the destination member of each member (-1:
    none, or a destination off the team)."""
    return [team.index(ranks[g]) if ranks[g] in team else -1 for g in team]


@cache
def torus(shape: tuple[int, ...]) -> Torus:
    return Torus(shape)


@cache
def _deltas(shape: tuple[int, ...], peers: str, axes: Axes | None) -> frozenset[int]:
    t = Torus(shape)
    if peers == "all":
        return frozenset(r for r in t.team(0, axes) if r != 0)
    assert len(t.axes(axes)) == 1, "next/prev and a shift need a team of one axis"
    k = {"next": 1, "prev": -1}.get(peers)
    delta = t.peer(0, axes, int(peers) if k is None else k)  # a shift's "+k": its offset
    return frozenset({delta}) if delta else frozenset()


@cache
def _shift(shape: tuple[int, ...], d: int) -> list[int]:
    """perm[q] = q - d, built axis by axis (row-major: the last axis fastest), O(W)
    cheap steps: the happens-before checker asks it for every translation of a clock,
    and a coordinate round trip per rank made a mesh of 5 axes take 30 s."""
    perm = [0]
    for size, by in zip(shape, Torus(shape).coords(d), strict=True):
        perm = [p * size + (c - by) % size for p in perm for c in range(size)]
    return perm


def rank_text(world: int, rank: int, axis_names: Sequence[str] | None = None) -> str:
    """How a counterexample names a rank: ``rank 3``, or ``rank (node=1, gpu=0)``."""
    if not isinstance(world, MeshWorld):
        return f"rank {rank}"
    names = axis_names or [f"a{i}" for i in range(len(world.shape))]
    return "rank " + torus(world.shape).name(rank, names)


def rotations(names: Iterable[str]) -> dict[str, list[int]]:
    """Of the buffer names of an unrolled schedule, each buffer held as rotations of the
    rank (``ROTATION``: ``b_rot<c>`` with no ``b`` beside them) -> its c's, sorted."""
    names = set(names)
    found: dict[str, list[int]] = {}
    for name in names:
        hit = re.fullmatch(ROTATION.format("([a-z][a-z0-9_]*)", "([0-9]+)"), name)
        if hit and hit.group(1) not in names:
            found.setdefault(hit.group(1), []).append(int(hit.group(2)))
    return {k: sorted(v) for k, v in sorted(found.items())}
