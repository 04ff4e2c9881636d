"""Whether a race's counterexample is an execution that can happen, checked rank by rank
against the brute-force oracle's graph (support.hb_oracle.build: every rank's own steps,
a ``when:`` evaluated on each rank, one wait node per peer polled, each after the one
signal it needs), independently of dcpc.check.hb.

The timeline a finding prints (``a legal execution``) says per rank and call which steps
ran (✓), were skipped (``(skipped)``: the step's when: fails there), have sent but not
finished their wait (``(sent)``, ``(sent, waiting)``), or run next (``→``, ``(next)``).
It is legal when the events it says ran are closed under the graph's edges (no wait done
before the signal it polls was sent, no step shown skipped where it runs nor run where
it is skipped) and each of the two accesses can run next: every event before it is done
or part of its own step in progress (or, a store in flight, it ran and has not landed:
its owner's wait of the step that lands it has not finished).

    violations(schedule, finding_json) -> list of what is wrong (empty: legal)
"""

from __future__ import annotations

import re

import networkx as nx

from support.hb_oracle import build

_LINE = re.compile(r"^rank (\d+)(?:, slot (\d+))?: (.*)$")
_MARK = r"(✓|\(skipped\)|\(sent\)|\(sent, waiting\)|\(next\)|→)"


def _states(timeline: list[str], names: list[str]) -> dict[tuple[int, int, str], str] | None:
    """(rank, call, step) -> its mark, for every step the timeline names; None when a
    line is not one rank's (a mesh's, or ranks left out)."""
    out: dict[tuple[int, int, str], str] = {}
    item = re.compile(r"(?:^|\s)(" + "|".join(map(re.escape, names)) + r") " + _MARK)
    for line in timeline:
        found = _LINE.match(line)
        if found is None:
            return None
        rank = int(found.group(1))
        for chunk in found.group(3).split(" | "):
            head = re.match(r"call (\d+) (.*)$", chunk)
            if head is None:
                continue
            call = int(head.group(1))
            for m in item.finditer(head.group(2)):
                out[(rank, call, m.group(1))] = m.group(2)
                if m.group(2) != "✓" and m.group(2) != "(skipped)":
                    break  # what follows the step that runs next is its note
    return out


def violations(schedule, finding: dict, calls: int | None = None) -> list[str] | None:
    """What makes ``finding``'s (JSON) race counterexample impossible; [] when legal,
    None when the timeline is not checkable here (a mesh, hidden ranks)."""
    names = [s.name for s in schedule.step_list()]
    states = _states(finding["timeline"], names)
    if states is None:
        return None
    world = finding["world"]
    graph = build(schedule, world, calls)
    bad: list[str] = []
    done: set[int] = set()
    present = {(d["rank"], d["call"], d["step"]) for _, d in graph.nodes(data=True)}
    for (rank, call, step), mark in states.items():
        if mark == "(skipped)" and (rank, call, step) in present:
            bad.append(f"rank {rank} call {call} {step}: shown skipped, but it runs there")
    for node, d in graph.nodes(data=True):
        mark = states.get((d["rank"], d["call"], d["step"]))
        if mark == "✓" or (mark in ("(sent)", "(sent, waiting)") and d["phase"] == 0):
            done.add(node)
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
                  and states.get((owner, loc["call"], names[graph.nodes[n]["lands"]])) != "✓"]
        enabled = flying + [n for n in nodes if n not in done and all(
            a in done or (graph.nodes[a]["rank"], graph.nodes[a]["call"],
                          graph.nodes[a]["step"]) == own for a in nx.ancestors(graph, n))]
        if not enabled:
            bad.append(f"{side}: {loc['step']} on rank {loc['rank']} call {loc['call']} "
                       "cannot run next from the execution shown")
    return bad
