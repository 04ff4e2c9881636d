"""Stage 2, graph: the dataflow graph of a schedule.

Steps and buffers are nodes; an edge buffer -> step is a read, step -> buffer a
write, as the op's entry in dcpc.lang.semantics says (the one definition every stage
reads). ``DiGraph`` is the part of networkx's that the stage uses (the same calls and
order), so that ``dcpc check`` does not import networkx (a third of its start-up).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dcpc.lang import model
from dcpc.lang.semantics import Semantics, table


class DiGraph:
    """Nodes and directed edges with attributes, in insertion order (networkx's
    ``DiGraph`` API as this module uses it: ``graph``, ``add_node``, ``add_edge``,
    ``nodes(data=True)``, ``edges(data=True)``; edges listed by source node)."""

    def __init__(self, **attrs: Any):
        self.graph: dict[str, Any] = dict(attrs)
        self._nodes: dict[str, dict[str, Any]] = {}
        self._out: dict[str, dict[str, dict[str, Any]]] = {}

    def add_node(self, node: str, **attrs: Any) -> None:
        self._nodes.setdefault(node, {}).update(attrs)
        self._out.setdefault(node, {})

    def add_edge(self, src: str, dst: str, **attrs: Any) -> None:
        self.add_node(src)
        self.add_node(dst)
        self._out[src].setdefault(dst, {}).update(attrs)

    def nodes(self, data: bool = False) -> Iterator[Any]:
        return iter(self._nodes.items() if data else self._nodes)

    def edges(self, data: bool = False) -> Iterator[Any]:
        for src, out in self._out.items():
            for dst, attrs in out.items():
                yield (src, dst, attrs) if data else (src, dst)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)


def dataflow(schedule: model.Schedule, semantics: list[Semantics] | None = None) -> DiGraph:
    """The dataflow graph: ``step:<name>`` and ``buf:<name>`` nodes, read/write edges
    (``semantics``: the schedule's table, asked when not given)."""
    graph = DiGraph(name=schedule.schedule)
    for name, buf in schedule.buffers.items():
        graph.add_node(
            f"buf:{name}",
            kind="buffer",
            label=name,
            shape=[str(d) for d in buf.shape],
            dtype=buf.dtype.value,
            symmetric=buf.is_symmetric,
            shared=buf.shared,
        )
    semantics = table(schedule, semantics)
    for step in schedule.step_list():
        node = f"step:{step.name}"
        graph.add_node(node, kind="step", label=step.name, op=step.kind, index=step.index)
        access = semantics[step.index]
        for name in access.reads:
            graph.add_node(f"buf:{name}", kind="buffer", label=name)
            graph.add_edge(f"buf:{name}", node, access="read")
        for name in access.writes:
            graph.add_node(f"buf:{name}", kind="buffer", label=name)
            graph.add_edge(node, f"buf:{name}", access="write")
    return graph


def dot_quote(text: str) -> str:
    """A Graphviz quoted string (backslashes, quotes and newlines escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: DiGraph) -> str:
    """Graphviz DOT text: steps are boxes (in program order), symmetric buffers bold."""
    lines = [f"digraph {dot_quote(graph.graph.get('name', 'schedule'))} {{", "  rankdir=LR;"]
    for node, attrs in graph.nodes(data=True):
        if attrs.get("kind") == "step":
            label = dot_quote(f"{attrs['index']}. {attrs['label']}\n{attrs.get('op', '')}")
            lines.append(f"  {dot_quote(node)} [shape=box, style=rounded, label={label}];")
        else:
            text = str(attrs.get("label", node))
            if "shape" in attrs:
                text += f"\n[{', '.join(attrs['shape'])}] {attrs['dtype']}"
            style = "bold" if attrs.get("symmetric") else "solid"
            label = dot_quote(text)
            lines.append(f"  {dot_quote(node)} [shape=ellipse, style={style}, label={label}];")
    for src, dst, attrs in graph.edges(data=True):
        style = "dashed" if attrs.get("access") == "read" else "solid"
        lines.append(f"  {dot_quote(src)} -> {dot_quote(dst)} [style={style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
