"""Mesh teams at run time: what a generated module's team op (``axis:``) reaches.

A schedule with ``mesh:`` gets ``MESH`` (axes and what sizes them) and ``TEAMS`` (step ->
its team's axis positions) in its generated class. The mesh shape is bound at
construction from the axes' sizes (``sizes={"N": 2, "G": 4}``); its product must be the
group's size. Teams, member indices and peers come from dcpc.topology (the one
definition every stage reads). A team op's kernel gets its member index and team size
as RANK/WORLD, the team's global ranks (``team_ranks``: its signal lanes and flags stay
global) and its buffers' pointer tables in member order; on the torch backend it runs
on one process group per team and slot, made by every rank in the same order.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch

from dcpc.runtime.errors import DcpcArgumentError


def torus(shape: tuple[int, ...]) -> Any:
    """dcpc.topology's torus, imported on first use: a module without ``mesh:`` imports
    nothing beyond dcpc.runtime (tests/run/test_run_cli.py); dcpc.topology is stdlib only."""
    from dcpc.topology import torus as make

    return make(shape)

_TEAM_GROUPS: dict[tuple[tuple[int, ...], int], Any] = {}  # (global ranks, slot) -> group


class TeamsMixin:
    """The team helpers the emitted code of team ops calls (``self._team_*``)."""

    MESH: ClassVar[tuple[tuple[str, str | int], ...]] = ()
    # the worlds the schedule was checked for (W, or mesh shapes on a mesh); () for none
    WORLDS: ClassVar[tuple[int | tuple[int, ...], ...]] = ()
    TEAMS: ClassVar[dict[str, tuple[int, ...]]] = {}
    SIGNALLING: ClassVar[tuple[str, ...]] = ()
    WHEN: ClassVar[dict[str, tuple]] = {}

    rank: int
    world: int
    device: torch.device
    group: Any
    poison: bool
    backend: str
    backends: dict[str, str]
    _groups: dict[str, Any]
    _one: torch.Tensor
    _comms: list[Any]
    _on_torch: frozenset[str]
    _torch_teams: dict[str, tuple[int, ...]]
    _mixed: bool
    _timeout_s: float
    SLOTS: ClassVar[int]
    _peers: dict[str, list[torch.Tensor]]

    def _bind_mesh(self, env: dict[str, int]) -> None:
        """The mesh shape from the bound sizes; its product must be W."""
        if not self.MESH:
            self.mesh_shape: tuple[int, ...] = (self.world,)
        else:
            self.mesh_shape = tuple(env[s] if isinstance(s, str) else s for _, s in self.MESH)
        total = 1
        for s in self.mesh_shape:
            total *= s
        if total != self.world:
            shape = " x ".join(f"{a}={s}" for (a, _), s in zip(self.MESH, self.mesh_shape,
                                                               strict=True))
            raise DcpcArgumentError(
                f"{type(self).__name__}: the mesh {shape} has {total} ranks, but the group "
                f"has {self.world}")
        self._team_cache: dict[tuple, Any] = {}

    def _check_proved(self) -> None:
        """The group is one of the worlds the module was proved for (after the checks
        of a module unrolled for one W or mesh shape, whose message says more)."""
        # the proof covers the worlds the module was checked for, no other: a ring
        # offset, a chain or a credit that is safe at W 2..8 need not be at W = 10. A
        # group of one rank (group=None) has no peer to race with and is always served.
        here = self.mesh_shape if self.MESH else self.world
        proved = self.WORLDS
        if self.world > 1 and proved and here not in proved:
            said = "x".join(map(str, here)) if self.MESH else str(here)
            shown = ", ".join("x".join(map(str, w)) if isinstance(w, tuple) else str(w)
                              for w in proved)
            raise DcpcArgumentError(
                f"{type(self).__name__}: this module was proved and compiled for W "
                f"{shown}, but the group is {said}; compile it with --world {said} (or a "
                "list of worlds that holds it)")

    def _team(self, step: str) -> tuple[list[int], int]:
        """(the team's global ranks in member order, this rank's member index)."""
        key = ("team", step)
        found = self._team_cache.get(key)
        if found is None:
            members = torus(self.mesh_shape).team(self.rank, self.TEAMS[step])
            found = self._team_cache[key] = (members, members.index(self.rank))
        return found

    def _team_member(self, step: str) -> int:
        return self._team(step)[1]

    def _team_size(self, step: str) -> int:
        return len(self._team(step)[0])

    def _team_peer(self, step: str, k: int, wrap: bool) -> int:
        """The global rank of member ``+k`` of this rank's team of ``step`` (a shift's TO
        / FROM: dcpc.topology ``Torus.peer``); this rank itself where ``wrap`` False
        finds none past an end (the kernel then masks its lane off)."""
        key = ("peer", step, k, wrap)
        found = self._team_cache.get(key)
        if found is None:
            peer = torus(self.mesh_shape).peer(self.rank, self.TEAMS[step], k, wrap)
            found = self._team_cache[key] = self.rank if peer is None else peer
        return found

    def _team_table(self, step: str) -> torch.Tensor:
        """The team's global ranks (int32, on the device): the kernel's signal lanes."""
        key = ("table", step)
        found = self._team_cache.get(key)
        if found is None:
            found = self._team_cache[key] = torch.tensor(
                self._team(step)[0], dtype=torch.int32, device=self.device)
        return found

    def _team_peers(self, step: str, name: str, slot: int) -> torch.Tensor:
        """Buffer ``name``'s pointer table of ``slot`` in the team's member order."""
        key = ("peers", step, name, slot)
        found = self._team_cache.get(key)
        if found is None:
            table = self._peers[name][slot]
            index = torch.tensor(self._team(step)[0], dtype=torch.long, device=table.device)
            found = self._team_cache[key] = table.index_select(0, index).contiguous()
        return found

    def _make_team_tables(self) -> None:
        """Every team's rank table and pointer tables, made at construction so that a call
        allocates nothing (CUDA-graph capture; several ranks in one process)."""
        for step in self.TEAMS:
            self._team_table(step)
            for name, tables in self._peers.items():
                for slot in range(len(tables)):
                    self._team_peers(step, name, slot)

    def _team_comm(self, step: str, slot: int) -> Any:
        """The torch backend's SlotGroup of this rank's team of ``step`` for ``slot``."""
        return self._team_cache[("comm", self.TEAMS[step], slot)]

    def _make_groups(self) -> None:
        """Every process group the torch steps run on (``_comms``: one per slot; the
        teams' and the guarded steps' runners'), then, on the CPU, ONE barrier over the
        group: every rank's gloo groups are connected before any rank goes on. Torch makes
        no barrier after new_group, and a rank that returned (and exited) at once failed
        the connectFullMesh of a peer still making its group ("Connection closed by
        peer", CI of int27). Every new_group of a construction comes before it
        (``_team_heap``'s too). Inert on cuda (NCCL connects at first use)."""
        from dcpc.runtime.collectives import barrier, slot_groups

        timeout_s = self._timeout_s if self.device.type == "cpu" else None
        self._comms = slot_groups(self.group, self.rank, self.world,
                                  self.SLOTS if self._on_torch else 0, timeout_s,
                                  type(self).__name__)
        if self.backend == "torch" and self.TEAMS:
            self._make_team_groups(self.SLOTS, timeout_s)
        elif self._mixed:
            self._make_team_groups(self.SLOTS, timeout_s, set(self._torch_teams.values()),
                                   self._groups)
        if self.WHEN and self._on_torch:  # a guarded torch step's barrier: its runners only
            self._make_runner_groups(self.SLOTS, timeout_s)
        if self._on_torch and self.world > 1 and self.device.type == "cpu":
            barrier(self._comms[0], self._one, self.world)

    def _make_team_groups(self, slots: int, timeout_s: float | None,
                          only: set[tuple[int, ...]] | None = None,
                          given: dict[str, Any] | None = None) -> None:
        """One process group per (team axes, team, slot), made by EVERY rank in the same
        order (torch.distributed.new_group is collective over the default group;
        connected on every rank before any goes on by ``_make_groups``' barrier).
        ``only``: these team axes (per-axis backends: the torch steps' teams); ``given``:
        the engine's group of an axis (``groups=``) serves slot 0 of that axis' teams."""
        import torch.distributed as dist

        from dcpc.runtime.collectives import SlotGroup

        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        wanted = sorted(set(self.TEAMS.values()) if only is None else only)
        if self.world == 1:  # one rank (no group): every team is this rank alone
            for axes in wanted:
                for slot in range(slots):
                    self._team_cache[("comm", axes, slot)] = SlotGroup(
                        self.group, slot, 0, timeout, 0, (), (0,))
            return
        glob = dist.get_process_group_ranks(self.group)
        t = torus(self.mesh_shape)
        for axes in wanted:
            teams = sorted({tuple(t.team(r, axes)) for r in range(self.world)})
            mine = self.MESH[axes[0]][0] if len(axes) == 1 else None
            for slot in range(slots):
                for members in teams:
                    ranks = tuple(glob[m] for m in members)
                    group = _TEAM_GROUPS.get((ranks, slot))
                    if slot == 0 and given and mine in given:
                        # the engine's own groups along this axis: every rank passed them
                        # (a rendezvous fact), so every rank skips making these alike
                        if self.rank not in members:
                            continue
                        group = given[mine]
                    elif group is None:
                        group = _TEAM_GROUPS[(ranks, slot)] = dist.new_group(list(ranks))
                    if self.rank in members:
                        member = members.index(self.rank)  # the group's; errors name ranks
                        self._team_cache[("comm", axes, slot)] = SlotGroup(
                            group, slot, member, timeout, self.rank,
                            tuple(m for m in members if m != self.rank), tuple(members))

    def _make_runner_groups(self, slots: int, timeout_s: float | None) -> None:
        """The torch steps' guarded signalling steps (``when:``): for each, the ranks of
        each of its teams (the group, off a mesh) that run it, and one process group per
        such set that is neither the whole team nor one rank, made by EVERY rank in the
        same order (each computes every rank's ``runs()``): ``_meet`` is a barrier over
        exactly the ranks that reach it (a wait guarded by rank, a guarded team shift's
        settle), where one over the team would wait for a rank that skips the step."""
        import torch.distributed as dist

        from dcpc.runtime.collectives import SlotGroup

        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        glob, t = self._global_ranks(), torus(self.mesh_shape)
        for step in self.SIGNALLING:
            if step not in self.WHEN or step not in self._on_torch:
                continue
            axes = self.TEAMS.get(step)
            teams = ([list(range(self.world))] if axes is None else
                     sorted({tuple(t.team(r, axes)) for r in range(self.world)}))
            for team in teams:
                runners = [m for m in team if self.runs(step, m)]
                mine = self.rank in runners
                for slot in range(slots):
                    if len(runners) == len(team):  # the team's own group
                        if mine:
                            comm = (self._comms[slot] if axes is None
                                    else self._team_comm(step, slot))
                            self._team_cache[("runners", step, slot)] = (comm, len(team))
                        continue
                    if len(runners) < 2:  # nobody to meet
                        if mine:
                            self._team_cache[("runners", step, slot)] = (None, 1)
                        continue
                    ranks = tuple(glob[m] for m in runners)
                    group = _TEAM_GROUPS.get((ranks, slot))
                    if group is None:
                        group = _TEAM_GROUPS[(ranks, slot)] = dist.new_group(list(ranks))
                    if mine:
                        comm = SlotGroup(group, slot, runners.index(self.rank), timeout,
                                         self.rank, tuple(m for m in runners
                                                          if m != self.rank), tuple(runners))
                        self._team_cache[("runners", step, slot)] = (comm, len(runners))

    def _meet(self, step: str, slot: int) -> None:
        """A barrier over the ranks of this rank's team of guarded ``step`` (the group,
        off a mesh) that run it (``_make_runner_groups``)."""
        from dcpc.runtime.collectives import barrier

        comm, size = self._team_cache[("runners", step, slot)]
        barrier(comm, self._one, size)

    # ---- per-axis backends (dcpc.runtime.axes) ------------------------------------------
    def _settle(self, step: str, slot: int) -> None:
        """After a torch step of a module whose other axes run kernels: its team meets
        (a barrier), so that every member's collective has written its result before
        any member returns, as the proof assumed of a step's writes (docs/hb-checker.md,
        "Per-axis backends"): a gloo or NCCL collective returns on one rank while a
        peer may still be receiving."""
        from dcpc.runtime.collectives import barrier

        if step in self.WHEN:  # guarded: only the team's members that run it meet
            self._meet(step, slot)
            return
        barrier(self._team_comm(step, slot), self._one, self._team_size(step))

    def _global_ranks(self) -> list[int]:
        if self.group is None:
            return list(range(self.world))
        import torch.distributed as dist

        return list(dist.get_process_group_ranks(self.group))

    def _axis_teams(self) -> dict[str, list[int]]:
        """Axis -> the global ranks of this rank's team along that one axis."""
        glob, t = self._global_ranks(), torus(self.mesh_shape)
        return {axis: [glob[m] for m in t.team(self.rank, (p,))]
                for p, (axis, _) in enumerate(self.MESH)}

    def _team_heap(self) -> Any:
        """The symmetric heap over the team of the symmetric axes only (one group per such
        team, made by every rank in the same order, or the engine's ``groups=`` of the one
        symmetric axis), its pointer tables indexed by this module's ranks. Its groups
        are connected on every rank before any goes on by ``_make_groups``' barrier,
        which comes later in the same construction (a mixed module has torch steps)."""
        import torch.distributed as dist

        from dcpc.runtime.axes import TeamHeap
        from dcpc.runtime.backend import make_heap

        symm = tuple(p for p, (axis, _) in enumerate(self.MESH)
                     if self.backends[axis] != "torch")
        glob, t = self._global_ranks(), torus(self.mesh_shape)
        members = t.team(self.rank, symm)
        named = [self.MESH[p][0] for p in symm]
        if self.world == 1:
            sub = self.group
        elif len(named) == 1 and named[0] in self._groups:
            sub = self._groups[named[0]]
        else:
            sub = None
            for team in sorted({tuple(t.team(r, symm)) for r in range(self.world)}):
                ranks = tuple(glob[m] for m in team)
                group = _TEAM_GROUPS.get((ranks, 0))
                if group is None:
                    group = _TEAM_GROUPS[(ranks, 0)] = dist.new_group(list(ranks))
                if self.rank in team:
                    sub = group
        inner = make_heap(self.backend, sub, self.device, self.poison)
        return TeamHeap(inner, members, self.rank, self.world)
