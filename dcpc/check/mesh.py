"""Structural checks of ``mesh:`` and of every op's ``axis:`` (dcpc.lang.mesh)."""

from __future__ import annotations

import math

from dcpc.check.context import Context
from dcpc.diagnostics import Diagnostic, did_you_mean
from dcpc.lang.expr import OWNER
from dcpc.lang.mesh import MAX_AXES, MAX_WORLD, mesh_of
from dcpc.lang.model import Peers, Schedule, SizeSpec, Step
from dcpc.lang.sizes import WORLD
from dcpc.lang.when import RANK
from dcpc.ops import OPS


def check_mesh(ctx: Context) -> None:
    """The axes and their sizes, then each step's ``axis:``."""
    schedule = ctx.schedule
    ctx.out += mesh_diagnostics(schedule)
    mesh = mesh_of(schedule)
    sems = ctx.semantics
    for step in ctx.steps:
        _check_peers(ctx, step)
        _check_shift(ctx, step)
        value = step.op.axis
        if value is None:
            continue
        names = [value] if isinstance(value, str) else list(value)
        keys = ["axis"] if isinstance(value, str) else [f"axis[{i}]" for i in range(len(names))]
        sync = sems[step.index].sync
        if sync.signal is None and sync.wait is None:
            ctx.error(step.op.mark("axis", of_key=True), "axis-on-local-op",
                      f"step '{step.name}' ({step.kind}) runs on this rank only; 'axis' "
                      "names the mesh axes of a communication op",
                      hint="drop 'axis' here")
            continue
        if mesh.team_axes(step.op) is not None and not _team_op(step):
            ctx.error(step.op.mark("axis", of_key=True), "axis-unsupported",
                      f"step '{step.name}' ({_what(step)}) runs over every mesh axis only so "
                      "far; its team lowering and proof are not written yet",
                      hint="drop 'axis' (every axis), or express the step with ops that "
                      f"take a team: {', '.join(team_ops())}")
            continue
        seen: set[str] = set()
        for name, key in zip(names, keys, strict=True):
            if name in seen:
                ctx.error(step.op.mark(key), "duplicate-axis",
                          f"step '{step.name}' names axis '{name}' twice")
            seen.add(name)
            if mesh.position(name) is None:
                where = ("the schedule declares no 'mesh:' (its one axis is 'world')"
                         if not mesh.declared else f"the mesh's axes are {', '.join(mesh.axes)}")
                ctx.error(step.op.mark(key), "unknown-axis",
                          f"step '{step.name}' runs over axis '{name}', but {where}",
                          hint=did_you_mean(name, mesh.axes)
                          or "name an axis of 'mesh:', or declare it there")


def team_ops() -> list[str]:
    """The ops that take ``axis:`` (``OpDef.teams``), as the docs list them."""
    return [f"{name} ({op.team_form})" if op.team_form else name
            for name, op in OPS.items() if op.teams]


def _team_op(step: Step) -> bool:
    """Whether the step may run over a team (its op's ``OpDef.takes_team``)."""
    return OPS[step.kind].takes_team(step.op)


def _what(step: Step) -> str:
    return OPS[step.kind].whole_mesh_form_of(step.op) or step.kind


def _check_shift(ctx: Context, step: Step) -> None:
    """A shift by an offset moves one coordinate (member r + k of a team of one axis, like
    ``ppermute`` over one axis name): over several axes, r + k of the linear rank is not
    a translation of the torus, which the proof's symmetry needs. A perm takes any team
    (its deltas are translations: dcpc.ops.common ``perm_delta``)."""
    mesh = mesh_of(ctx.schedule)
    team = mesh.team_axes(step.op)
    width = len(mesh.axes) if team is None else len(team)
    named = step.op.axis is not None
    names = [step.op.axis] if isinstance(step.op.axis, str) else step.op.axis or []
    if any(mesh.position(n) is None for n in names):
        return  # an unknown axis: its own error (unknown-axis) says what is wrong
    if step.kind == "shift" and width > 1 and step.op.perm is None:  # a perm: any team
        ctx.error(step.op.mark("axis", of_key=True) if named else step.mark(),
                  "axis-unsupported",
                  f"step '{step.name}' (shift) runs over {width} mesh axes "
                  f"({', '.join(mesh.names(team))}); a shift moves along one axis",
                  hint=f"name one axis: 'axis: {mesh.axes[-1]}' (or another single axis)")


def _check_peers(ctx: Context, step: Step) -> None:
    """next/prev and an offset move one coordinate: their team has one axis."""
    found = one_coordinate_peers(ctx, step)
    if found is None:
        return
    key, named, width = found
    mesh = mesh_of(ctx.schedule)
    ctx.error(step.op.mark(key), "axis-required",
              f"step '{step.name}' names '{named}' peers over {width} axes "
              f"({', '.join(mesh.names(mesh.team_axes(step.op)))}); next/prev move one "
              "coordinate, so they need one axis",
              hint=f"add 'axis: {mesh.axes[-1]}' (or another single axis)")


def one_coordinate_peers(ctx: Context, step: Step) -> tuple[str, str, int] | None:
    """Whether the step's peers move one coordinate (a signal's or wait's next, prev or
    offset, a ragged_all_to_all's offset) over a team of several axes, where they are
    undefined (``axis-required``; check/when.py reads no peers of such a step): (the key
    to point at, the peers as written, the team's width), or None. A shift says so
    itself (``_check_shift``: axis-unsupported); a perm takes any team."""
    if step.kind == "shift":
        return None
    mesh = mesh_of(ctx.schedule)
    team = mesh.team_axes(step.op)
    width = len(mesh.axes) if team is None else len(team)
    if width == 1:
        return None
    offset = getattr(step.op, "offset", None)
    if offset is not None and getattr(step.op, "perm", None) is None:
        return "offset", f"offset {offset}", width
    if step.kind in ("signal", "wait"):
        peers = step.op.to if step.kind == "signal" else step.op.from_
        if peers in (Peers.next, Peers.prev):
            return ("to" if step.kind == "signal" else "from"), peers.value, width
    return None


def mesh_diagnostics(schedule: Schedule) -> list[Diagnostic]:
    """What is wrong with a schedule's ``mesh:`` (empty without one). Every later stage
    reads the group sizes through the mesh, so a schedule with one of these is
    refused before anything else is checked (no follow-on errors of a broken mesh)."""
    out: list[Diagnostic] = []
    if schedule.mesh is None:
        return out
    mark = schedule.mark("mesh")
    if not schedule.mesh:
        return [Diagnostic(mark, "bad-mesh", "'mesh:' names no axis",
                           hint="write e.g. 'mesh: {node: N, gpu: G}', or drop 'mesh:'")]
    if len(schedule.mesh) > MAX_AXES:
        return [Diagnostic(mark, "bad-mesh",
                           f"'mesh:' has {len(schedule.mesh)} axes, above the limit of "
                           f"{MAX_AXES}", hint="merge axes that always move together")]
    sized: dict[str, str] = {}
    for axis, size in schedule.mesh.items():
        at = schedule.mark(f"mesh/{axis}")
        if not axis.isidentifier():
            out.append(Diagnostic(schedule.mark(f"mesh/{axis}", of_key=True), "bad-mesh",
                                  f"mesh axis '{axis}' is not an identifier"))
        elif axis in (OWNER, RANK, WORLD):  # an axis coordinate would shadow them
            out.append(Diagnostic(schedule.mark(f"mesh/{axis}", of_key=True), "bad-mesh",
                                  f"mesh axis '{axis}' has a name expressions reserve "
                                  f"('{OWNER}' and '{RANK}': the rank in the group, "
                                  f"'{WORLD}': the group's size)",
                                  hint="name the axis after what it spans, e.g. 'ring', "
                                  "'node', 'gpu'"))
        if isinstance(size, int):
            if size < 1:
                out.append(Diagnostic(at, "bad-mesh", f"mesh axis '{axis}' has size {size}; "
                                      "sizes are positive"))
            continue
        if not size.isidentifier() or size == WORLD:
            out.append(Diagnostic(
                at, "bad-mesh",
                f"mesh axis '{axis}' is sized by '{size}', which is not a size name"
                + (" (W is the product of the axes)" if size == WORLD else ""),
                hint="use a size name (e.g. 'G') or an integer"))
            continue
        if size in sized:
            out.append(Diagnostic(
                at, "bad-mesh", f"mesh axes '{sized[size]}' and '{axis}' are both sized by "
                f"'{size}'", hint="give each axis its own size name"))
        sized[size] = axis
        spec = schedule.sizes.get(size)
        if spec is not None and not (isinstance(spec, SizeSpec) and spec.multiple_of is None):
            out.append(Diagnostic(
                schedule.mark(f"sizes/{size}"), "bad-mesh",
                f"size '{size}' sizes mesh axis '{axis}', so it is bound by the mesh "
                "shape (--world); it can have a 'max', not a value or a multiple",
                hint=f"write '{size}: {{max: 8}}', or leave it out of sizes"))
    fixed = math.prod(v for v in schedule.mesh.values() if isinstance(v, int) and v >= 1)
    if fixed > MAX_WORLD:
        out.append(Diagnostic(mark, "bad-mesh", f"the mesh's integer axes alone make "
                              f"{fixed} ranks, above the largest group size {MAX_WORLD}"))
    return out
