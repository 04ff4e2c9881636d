"""Whether a race's counterexample is an execution that can happen, checked rank by rank
against the brute-force oracle's graph (support.hb_oracle.build: every rank's own steps,
a ``when:`` evaluated on each rank, one wait node per peer polled, each after the one
signal it needs), independently of dcpc.check.hb.

The timeline a finding prints (``a legal execution``) says per rank and call which steps
ran (✓), were skipped (``(skipped)``: the step's when: fails there; the engine still
reads what its method returns), have sent but not finished their wait (``(sent)``,
``(sent, waiting)``), or run next (``→``, ``(next)``). A rank is named by its index or,
on a mesh, by its coordinates (``rank (node=1, gpu=0)``). It is legal when the events it
says ran are closed under the graph's edges (no wait done before the signal it polls
was sent, no step shown skipped where it runs nor run where it is skipped) and each of
the two accesses can run next: every event before it is done or part of its own step in
progress (or, a store in flight, it ran and has not landed: its owner's wait of the step
that lands it has not finished). A rank the timeline leaves out (``not shown``) may have
run what the shown ones need, if what that needs on the shown ranks is done.

    violations(schedule, finding_json) -> list of what is wrong (empty: legal)
"""

from __future__ import annotations

import re

import networkx as nx

from dcpc.lang.mesh import MeshWorld
from support.hb_oracle import _runs, build

_LINE = re.compile(r"^rank (\d+|\([^)]*\))(?:, slot (\d+))?: (.*)$")
_HIDDEN = re.compile(r"^\(ranks ([\d, ]+) not shown: ")
# "(skipped) →": a skipped step whose returned buffer the engine reads next
_MARK = r"(✓|\(skipped\) →|\(skipped\)|\(sent\)|\(sent, waiting\)|\(next\)|→)"


def _rank(name: str, shape: tuple[int, ...]) -> int:
    """A rank's index from its name in a timeline: ``3`` or ``(node=1, gpu=0)``."""
    if not name.startswith("("):
        return int(name)
    rank = 0
    for size, coord in zip(shape, re.findall(r"=(\d+)", name), strict=True):
        rank = rank * size + int(coord)
    return rank


def _states(timeline: list[str], names: list[str], shape: tuple[int, ...]
            ) -> tuple[dict[tuple[int, int, str], str], set[int]] | None:
    """(rank, call, step) -> its mark, for every step the timeline names, and the ranks
    it leaves out; None when a line is neither one rank's nor the ranks left out."""
    out: dict[tuple[int, int, str], str] = {}
    hidden: set[int] = set()
    item = re.compile(r"(?:^|\s)(" + "|".join(map(re.escape, names)) + r") " + _MARK)
    for line in timeline:
        found = _LINE.match(line)
        left = _HIDDEN.match(line)
        if left is not None:
            hidden |= {int(r) for r in left.group(1).split(", ")}
            continue
        if found is None:
            return None
        rank = _rank(found.group(1), shape)
        for chunk in found.group(3).split(" | "):
            head = re.match(r"call (\d+) (.*)$", chunk)
            if head is None:
                continue
            call = int(head.group(1))
            for m in item.finditer(head.group(2)):
                out[(rank, call, m.group(1))] = m.group(2)
                if m.group(2) != "✓" and m.group(2) != "(skipped)":
                    break  # what follows the step that runs next is its note
    return out, hidden


def violations(schedule, finding: dict, calls: int | None = None) -> list[str] | None:
    """What makes ``finding``'s (JSON) race counterexample impossible; [] when legal,
    None when the timeline is not checkable here (a line neither one rank's nor the
    ranks left out)."""
    names = [s.name for s in schedule.step_list()]
    world = finding["world"]
    if isinstance(world, str):  # a mesh's shape, "2x3"
        world = MeshWorld(tuple(int(s) for s in world.split("x")))
    shape = tuple(getattr(world, "shape", (int(world),)))
    read = _states(finding["timeline"], names, shape)
    if read is None:
        return None
    states, hidden = read
    graph = build(schedule, world, calls)
    bad: list[str] = []
    done: set[int] = set()
    # the engine's read of a skipped step's return is no sign that the step runs there
    present = {(d["rank"], d["call"], d["step"]) for _, d in graph.nodes(data=True)
               if not d.get("returned")}
    ops = {s.name: s.op for s in schedule.step_list()}
    for (rank, call, step), mark in states.items():
        if mark.startswith("(skipped)") and (rank, call, step) in present:
            bad.append(f"rank {rank} call {call} {step}: shown skipped, but it runs there")
        if mark == "✓" and not _runs(schedule, ops[step], rank, world):
            bad.append(f"rank {rank} call {call} {step}: shown run, but it is skipped there")
    for node, d in graph.nodes(data=True):
        mark = states.get((d["rank"], d["call"], d["step"]))
        if mark == "✓" or (mark in ("(sent)", "(sent, waiting)") and d["phase"] == 0) or (
                mark == "(skipped)" and d.get("returned")):
            done.add(node)
    # a rank left out ran what the shown ranks' done events need (and nothing more)
    needed = {a for n in done for a in nx.ancestors(graph, n)
              if graph.nodes[a]["rank"] in hidden}
    done |= needed
    for node in done:
        for pred in graph.predecessors(node):
            if pred not in done:
                d, p = graph.nodes[node], graph.nodes[pred]
                bad.append(f"rank {d['rank']} call {d['call']} {d['step']} ran before "
                           f"rank {p['rank']} call {p['call']} {p['step']}, which it needs")
    for side in ("first", "second"):
        loc = finding[side]
        own = (loc["rank"], loc["call"], loc["step"])
        kind = "read" if loc["access"] == "read" else "write"
        owner = loc.get("owner", loc["rank"])
        nodes = [n for n, d in graph.nodes(data=True)
                 if (d["rank"], d["call"], d["step"]) == own and d.get("buffer") == finding[
                     "buffer"] and d.get("kind") == kind and d.get("owner") == owner]
        if not nodes:
            bad.append(f"{side}: {loc['step']} on rank {loc['rank']} makes no such access")
            continue
        # a store in flight (a shift's put) that ran but has not landed: its owner's wait
        # of the landing step has not finished
        flying = [n for n in nodes if n in done and graph.nodes[n].get("lands") is not None
                  and states.get((owner, loc["call"], names[graph.nodes[n]["lands"]])) != "✓"
                  and not any((graph.nodes[m]["rank"], graph.nodes[m]["call"],
                               graph.nodes[m]["step"]) == (owner, loc["call"], names[
                                   graph.nodes[n]["lands"]]) for m in needed)]
        enabled = flying + [n for n in nodes if n not in done and all(
            a in done or (graph.nodes[a]["rank"], graph.nodes[a]["call"],
                          graph.nodes[a]["step"]) == own or _may_run(graph, a, done, hidden)
            for a in nx.ancestors(graph, n))]
        if not enabled:
            bad.append(f"{side}: {loc['step']} on rank {loc['rank']} call {loc['call']} "
                       "cannot run next from the execution shown")
    return bad


def _may_run(graph: nx.DiGraph, node: int, done: set[int], hidden: set[int]) -> bool:
    """Whether ``node``, of a rank the timeline leaves out, can have run: everything it
    needs on the shown ranks is done."""
    return graph.nodes[node]["rank"] in hidden and all(
        a in done for a in nx.ancestors(graph, node) if graph.nodes[a]["rank"] not in hidden)
