"""Graphviz DOT of the unrolled happens-before graph (``dcpc graph --hb``)."""

from __future__ import annotations

from dcpc.check.hb.clocks import World, analyze
from dcpc.check.hb.events import Program, lower
from dcpc.check.hb.report import Finding, Location
from dcpc.graph import dot_quote
from dcpc.lang.mesh import shape_of, torus
from dcpc.lang.model import Schedule


def _node(rank: int, call: int, j: int) -> str:
    return f"r{rank}_c{call}_e{j}"


def _event_of(program: Program, finding: Finding, where: Location) -> int | None:
    """The event of ``where``'s step that the finding is about."""
    for j, event in enumerate(program.events):
        if program.steps[event.step].name != where.step:
            continue
        if where.access in ("read", "write"):
            if any(a.buffer == finding.buffer and a.kind == where.access for a in event.accesses):
                return j
        elif (where.access == "wait") == (event.wait is not None):
            return j
    return None


def _highlights(world: World, finding: Finding | None) -> set[str]:
    if finding is None:
        return set()
    out = set()
    for where in (finding.first, finding.second):
        if where is None or where.rank >= world.world or where.call >= world.calls:
            continue
        j = _event_of(world.program, finding, where)
        if j is not None:
            out.add(_node(where.rank, where.call, j))
    return out


def hb_dot(schedule: Schedule, world: int, finding: Finding | None = None) -> str:
    """The unrolled HB graph for group size ``world``: one cluster per rank, program
    order solid, signal -> wait dashed, events that can never run dotted grey, and
    the two sides of ``finding`` (if any) in red with a dotted conflict edge."""
    program = lower(schedule)
    w = analyze(program, world)
    marked = _highlights(w, finding)
    out = [f"digraph {dot_quote('hb_' + program.name)} {{", "  rankdir=TB;",
           '  node [shape=box, fontsize=10, fontname="monospace"];']
    for rank in range(world):
        out.append(f"  subgraph cluster_rank{rank} {{")
        out.append(f"    label={dot_quote(f'rank {rank}')};")
        for call in range(w.calls):
            for j, event in enumerate(program.events):
                step = program.steps[event.step]
                label = f"call {call} (slot {call % program.slots})\n{step.name} [{event.phase}]"
                for a in event.accesses:
                    label += f"\n{a.kind[0]} {a.buffer}" + (
                        "" if not a.remote else " (all ranks)" if a.region.owners_all
                        else f" (rank {a.region.offset:+d})")
                style = []
                if not w.live[w.pos(call, j)]:
                    style.append("style=dotted, fontcolor=grey")
                if _node(rank, call, j) in marked:
                    style.append("color=red, penwidth=2.5, fontcolor=red")
                attrs = ", ".join([f"label={dot_quote(label)}"] + style)
                out.append(f"    {_node(rank, call, j)} [{attrs}];")
        out.append("  }")
    for rank in range(world):
        for call in range(w.calls):
            before = program.previous_call(call)
            for j in range(len(program.events)):
                if j:
                    out.append(f"  {_node(rank, call, j - 1)} -> {_node(rank, call, j)};")
                elif before >= 0:
                    last = len(program.events) - 1
                    out.append(f"  {_node(rank, before, last)} -> {_node(rank, call, 0)};")
                for d, js in w.match.get(j, ()):
                    if js is None:
                        continue
                    src = _node(torus(shape_of(world)).add(rank, d), call, js)
                    out.append(f"  {src} -> {_node(rank, call, j)} "
                               "[style=dashed, color=blue, constraint=false];")
    if len(marked) == 2:
        a, b = sorted(marked)
        label = f"{finding.cls} on {finding.buffer}" if finding is not None else ""
        out.append(f"  {a} -> {b} [dir=none, style=dotted, color=red, penwidth=2, "
                   f"constraint=false, label={dot_quote(label)}, fontcolor=red];")
    out.append("}")
    return "\n".join(out) + "\n"
