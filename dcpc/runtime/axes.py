"""Per-axis backends: ``backend={"node": "torch", "gpu": "host"}`` on a mesh module.

A generated module of a schedule with ``mesh:`` may run its axes on different backend
kinds: the inner axes on symmetric memory (``host`` on CPU, ``symm_mem`` on GPU: the
kernels) and the outer axes on ``torch`` (process groups: NCCL between nodes, gloo on
CPU). What this module decides at construction, once:

- ``split``: the mapping checked (every axis named once, known kinds, at most one
  symmetric kind beside torch; ``local`` never beside another kind) and each step's kind:
  a communicating step (it uses signal slots) runs over its team's axes (every axis
  when it names none), which must all be served by ONE kind, else the step is refused;
  a step that does not communicate runs as a kernel on the symmetric kind. A mapping
  with one kind for every axis is that plain kind (today's meaning).
- ``check_groups``: ``groups=`` (optional) names, per axis, this rank's process group
  along it (its team over that one axis); each must be the team the mesh says.
- ``TeamHeap``: the symmetric heap over the symmetric axes' team only (host heap: one
  shared-memory segment per rank of the team); its pointer tables are widened to the
  module's W ranks with 0 for ranks outside the team, which no kernel of a symmetric
  step reaches (a step's kernel reaches its team only, and that team lies inside the
  symmetric team: ``split``).

The proof is unchanged: a torch step's collective is complete on return on every rank
of its team (docs/hb-checker.md, "Per-axis backends").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.heap import Segment, SymmetricBuffer

KINDS = ("symm_mem", "host", "torch", "local")
SYMMETRIC = ("symm_mem", "host")


@dataclass(frozen=True)
class AxisPlan:
    """What a per-axis ``backend=`` mapping decided (``kind`` alone: a plain backend)."""

    kind: str  # the plain kind, or the symmetric kind of a mixed mapping
    per_axis: dict[str, str]  # axis -> kind ({} for a plain string backend=)
    torch_steps: frozenset[str]  # steps that run their torch body
    symm_axes: tuple[int, ...]  # positions of the symmetric axes (mixed only)

    @property
    def mixed(self) -> bool:
        return bool(self.torch_steps) and self.kind != "torch"


def split(
    owner: str,
    backend: object,
    mesh: Sequence[tuple[str, Any]],
    teams: Mapping[str, tuple[int, ...]],
    signalling: Sequence[str],
) -> tuple[str, dict[str, str], dict[str, tuple[int, ...]]]:
    """(the kind the module resolves like a plain backend, axis -> kind, torch step ->
    its team's axis positions). A plain string: (it, {}, {})."""
    if not isinstance(backend, Mapping):
        return backend, {}, {}  # type: ignore[return-value]  (checked by check_device)
    axes = [a for a, _ in mesh]
    if not axes:
        raise DcpcArgumentError(
            f"{owner}: backend= as a mapping axis -> kind needs a schedule with mesh: "
            f"axes; this schedule has none, pass one kind (e.g. backend='host')")
    for axis, kind in backend.items():
        if axis not in axes:
            raise DcpcArgumentError(
                f"{owner}: backend= names axis {axis!r}, which the mesh does not have "
                f"(its axes: {', '.join(axes)})")
        if kind not in KINDS:
            raise DcpcArgumentError(
                f"{owner}: backend= gives axis '{axis}' the kind {kind!r}; the kinds are "
                f"{', '.join(KINDS)}")
    missing = [a for a in axes if a not in backend]
    if missing:
        raise DcpcArgumentError(
            f"{owner}: backend= gives no kind to axis {', '.join(map(repr, missing))}: name "
            f"every axis of the mesh ({', '.join(axes)})")
    per_axis = {a: str(backend[a]) for a in axes}
    kinds = set(per_axis.values())
    if len(kinds) == 1:
        return kinds.pop(), per_axis, {}
    if "local" in kinds:
        raise DcpcArgumentError(
            f"{owner}: backend 'local' runs every rank as a thread of one process; it "
            f"cannot share a mesh with another kind ({_show(per_axis)})")
    symm = kinds - {"torch"}
    if len(symm) > 1:
        raise DcpcArgumentError(
            f"{owner}: one symmetric kind per mesh, got {' and '.join(sorted(symm))} "
            f"({_show(per_axis)}); put the outer axes on torch")
    every = tuple(range(len(axes)))
    torch_steps: dict[str, tuple[int, ...]] = {}
    for step in signalling:
        over = teams.get(step, every)
        used = {per_axis[axes[p]] for p in over}
        if len(used) > 1:
            names = ", ".join(f"{axes[p]}: {per_axis[axes[p]]}" for p in over)
            raise DcpcArgumentError(
                f"{owner}: step '{step}' runs over axes {', '.join(axes[p] for p in over)}, "
                f"which backend= serves by different kinds ({names}); every axis of a step "
                f"must be on one kind: give them one kind, or split the step per axis")
        if used == {"torch"}:
            torch_steps[step] = over
    return symm.pop(), per_axis, torch_steps


def _show(per_axis: Mapping[str, str]) -> str:
    return ", ".join(f"{a}={k}" for a, k in per_axis.items())


def check_groups(owner: str, groups: object, per_axis: Mapping[str, str],
                 mesh: Sequence[tuple[str, Any]], members: Mapping[str, list[int]]
                 ) -> dict[str, Any]:
    """``groups=`` checked: axis -> this rank's process group along it. ``members``:
    axis -> the global ranks of this rank's team along that axis, in member order."""
    if groups is None:
        return {}
    if not per_axis:
        raise DcpcArgumentError(
            f"{owner}: groups= goes with backend= as a mapping axis -> kind (e.g. "
            f"{{'node': 'torch', 'gpu': 'host'}}); with one kind, pass group= only")
    if not isinstance(groups, Mapping):
        raise DcpcArgumentError(
            f"{owner}: groups= maps a mesh axis to this rank's process group along it, "
            f"got {type(groups).__name__}")
    axes = [a for a, _ in mesh]
    for axis in groups:
        if axis not in axes:
            raise DcpcArgumentError(
                f"{owner}: groups= names axis {axis!r}, which the mesh does not have "
                f"(its axes: {', '.join(axes)})")
    for axis in axes:
        kind = per_axis.get(axis)
        if kind in ("torch", *SYMMETRIC) and groups.get(axis) is None:
            raise DcpcArgumentError(
                f"{owner}: axis '{axis}' runs on {kind}, which needs this rank's process "
                f"group along it: groups= has none for '{axis}' (pass groups= for every "
                f"axis, or leave groups= out and the module makes them from group=)")
    import torch.distributed as dist

    for axis, group in groups.items():
        ranks = dist.get_process_group_ranks(group)
        if list(ranks) != list(members[axis]):
            raise DcpcArgumentError(
                f"{owner}: groups['{axis}'] holds global ranks {list(ranks)}, but this "
                f"rank's team along '{axis}' is {list(members[axis])} (rank = row-major "
                f"over the mesh axes, outermost first)")
    return dict(groups)


class TeamHeap:
    """A symmetric heap over a team (``inner``, a heap over the team's group), whose
    pointer tables are indexed by the module's rank: 0 for ranks outside the team."""

    def __init__(self, inner: Any, members: list[int], rank: int, world: int):
        self.inner, self.members = inner, members
        self.rank, self.world, self.device = rank, world, inner.device

    def allocate(self, nbytes: list[int]) -> list[SymmetricBuffer]:
        out: list[SymmetricBuffer] = []
        index = torch.tensor(self.members, dtype=torch.long)
        for seg in self.inner.allocate(nbytes):
            ptrs = torch.zeros(self.world, dtype=torch.int64)
            ptrs[index] = seg.peer_ptrs.to("cpu")
            out.append(Segment(seg.local, ptrs.to(seg.peer_ptrs.device)))
        return out

    def gone(self, rank: int) -> bool:
        """Whether module rank ``rank``'s process is gone (a member of this team on a
        heap that can tell, dcpc.runtime.host.HostHeap.gone); False otherwise."""
        gone = getattr(self.inner, "gone", None)
        if gone is None or rank not in self.members:
            return False
        return bool(gone(self.members.index(rank)))

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        self.inner.close()
