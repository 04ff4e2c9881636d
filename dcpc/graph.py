"""Stage 2, graph: the dataflow graph of a schedule (networkx).

Steps and buffers are nodes; an edge buffer -> step is a read, step -> buffer a
write, as the op's entry in dcpc.lang.semantics says (the one definition every stage
reads).
"""

from __future__ import annotations

import networkx as nx

from dcpc.lang import model
from dcpc.lang.semantics import table


def dataflow(schedule: model.Schedule) -> nx.DiGraph:
    """The dataflow graph: ``step:<name>`` and ``buf:<name>`` nodes, read/write edges."""
    graph = nx.DiGraph(name=schedule.schedule)
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
    semantics = table(schedule)
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


def to_dot(graph: nx.DiGraph) -> str:
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
