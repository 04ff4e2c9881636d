"""A brute-force oracle for dcpc.check.hb, written independently of it.

It builds the FULL unrolled event graph with networkx: every rank, every call of
the unroll window, and for every communication op one node per access, one store
node per target rank, one signal node per peer and one wait node per peer, in
stream order. Signal -> wait edges follow what the kernels do: a communication op
waits on its own signal slots, a ``wait`` step polls the slots of the one signal
step the language matches it with (dcpc.lang.semantics.channels), and call c's wait
is satisfied by the same call's signal of that step (epochs count a slot's calls).
It then computes the full transitive closure (ancestor bitsets over a topological
order) and compares EVERY pair of accesses to every symmetric buffer instance. No
symmetry, no coarse events, no vector clocks. A step with ``when:`` is lowered on the
ranks where its condition holds only (exact per rank).

A split-phase `shift`'s store is made at its put, but the language writes `dst` at the
matching `phase: wait` (the float64 reference lands it there): the store is in flight
from the put to the owner's wait, an interval, and two accesses conflict unless one
ends before the other starts (an ordinary access starts and ends at itself); an access
between a put and its wait is found whether a barrier orders it after the store or
nothing orders it. A `reduce` pushes into, and reads, the root's `via` only.

    oracle_keys(schedule, world, calls=None) -> set of (kind, class, buffer, step, step)
    oracle_unwritten(schedule, world) -> set of ("read-before-write", "", buffer, step, "")
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from functools import lru_cache, wraps
from itertools import count
from typing import TypeVar

import networkx as nx

from dcpc.exprs import holds
from dcpc.lang.expr import parse_condition
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.model import Schedule
from dcpc.lang.semantics import channels

T = TypeVar("T")

Key = tuple[str, str, str, str, str]


def _shape(world) -> tuple[int, ...]:
    """A mesh world's axis sizes (``world.shape``), else one axis of W."""
    return tuple(getattr(world, "shape", (int(world),)))


def _coords(rank: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def _axes(schedule: Schedule, op) -> frozenset[int]:
    """Positions of the op's ``axis:`` names in ``mesh:`` (every axis by default)."""
    names = list(schedule.mesh or {"world": "W"})
    value = getattr(op, "axis", None)
    if value is None:
        return frozenset(range(len(names)))
    return frozenset(names.index(v) for v in ([value] if isinstance(value, str) else value))


def _team(me: int, world, axes: frozenset[int]) -> list[int]:
    """Every rank that shares ``me``'s coordinates off ``axes`` (``me`` included)."""
    shape = _shape(world)
    mine = _coords(me, shape)
    return [r for r in range(int(world))
            if all(c == m or a in axes
                   for a, (c, m) in enumerate(zip(_coords(r, shape), mine, strict=True)))]


def _peers(spec: str, me: int, world, axes: frozenset[int] | None = None) -> list[int]:
    shape = _shape(world)
    axes = frozenset(range(len(shape))) if axes is None else axes
    if spec == "all":
        return [p for p in _team(me, world, axes) if p != me]
    if spec == "self":  # the rank's own flag: a signal to itself, a wait for itself
        return [me]
    (axis,) = axes  # next/prev: one axis
    coords = _coords(me, shape)
    coords[axis] = (coords[axis] + (1 if spec == "next" else -1)) % shape[axis]
    other = 0
    for c, size in zip(coords, shape, strict=True):
        other = other * size + c
    return [other] if other != me else []


def _one_peer(op, me: int, world, axes, sign: int) -> list[int] | None:
    """A signal's (``sign`` 1) or wait's (-1) one peer by ``offset`` (member me + k of its
    team, or me - k) or ``perm`` (the unrolled table over ranks: perm[me], or the rank
    whose destination is me), [] for none or itself; None: it names all/next/prev."""
    if getattr(op, "perm", None) is not None:
        dests = list(op.perm)
        found = dests[me] if sign > 0 else (dests.index(me) if me in dests else -1)
        return [found] if found >= 0 and found != me else []
    if getattr(op, "offset", None) is None:
        return None
    team = _team(me, world, frozenset(range(len(_shape(world)))) if axes is None else axes)
    found = team[(team.index(me) + sign * op.offset) % len(team)]
    return [found] if found != me else []


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


class _Builder:
    """Nodes of one rank's one call, appended in program order."""

    def __init__(self, graph: nx.DiGraph, ids: count, rank: int, call: int, slots: int,
                 chain_waits: bool = True):
        self.graph, self.ids, self.rank, self.call, self.slots = graph, ids, rank, call, slots
        self.chain_waits = chain_waits  # False: a line's or a perm's wait orders nothing
        self.nodes: list[int] = []

    def add(self, step: str, index: int, phase: int, **attrs) -> None:
        node = next(self.ids)
        self.graph.add_node(node, rank=self.rank, call=self.call, step=step, index=index,
                            phase=phase, **attrs)
        self.nodes.append(node)

    def access(self, step, index, phase, buffer, kind, owner=None, part=None,
               lands=None, returned=False, chunk=None) -> None:
        """``lands``: the index of the step at whose wait the data flow writes a store
        made here (a shift's), None: here. ``returned``: the engine's read of what the
        method returns (a race, never a read-before-write: a rank that received nothing
        returns what its buffer held)."""
        self.add(step, index, phase, buffer=buffer, kind=kind,
                 owner=self.rank if owner is None else owner, part=part, lands=lands,
                 returned=returned, chunk=chunk)


def _partition(schedule: Schedule, op) -> tuple:
    axes = _axes(schedule, op)  # parts of different teams' partitions may overlap
    if op.op == "all_to_all" and op.concat_dim is not None:  # block p along concat_dim
        return ("block", op.concat_dim % len(schedule.buffers[_as_list(op.dst)[0]].shape), 0,
                axes)
    if op.op == "all_gather":
        if op.interleave:
            return ("interleave", op.dim, op.interleave, axes)
        src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
        return ("index" if len(dst.shape) == len(src.shape) + 1 else "block", op.dim, 0, axes)
    return ("index", 0, 0, axes)


def _lower_step(b: _Builder, schedule: Schedule, name: str, index: int, op, world: int,
                tracked: set[str]) -> None:
    kind = op.op
    axes = _axes(schedule, op)

    def slot(n: str | None) -> str | None:  # a slot's chunk (b[s][:, i]): of its slot
        return (schedule.module_view_of(n) or n) if n is not None else None

    def chunk(n: str) -> tuple[int, int] | None:  # b[s][e]: (its axis of the slot, e)
        whole = schedule.module_view_of(n)
        part = schedule.slice_of(n) if whole is not None else None
        return None if part is None else (schedule.slice_axis(part[0]), part[1])

    def reads(names, phase):
        for n in names:
            if slot(n) in tracked:
                b.access(name, index, phase, slot(n), "read", chunk=chunk(n))

    def writes(names, phase):
        for n in names:
            if slot(n) in tracked:
                b.access(name, index, phase, slot(n), "write", chunk=chunk(n))

    def stores(names, part):
        for n in names:
            if n in tracked:
                for target in _team(b.rank, world, axes):
                    b.access(name, index, 0, n, "write", owner=target, part=part)

    def exchange():
        for peer in _peers("all", b.rank, world, axes):
            b.add(name, index, 0, signal=("step:" + name, peer))
        for peer in _peers("all", b.rank, world, axes):
            b.add(name, index, 1, wait=("step:" + name, peer))

    masks = []
    if getattr(op, "mask_empty", None) is not None:
        masks = [op.mask_empty.seq_lens, op.mask_empty.query_start_loc]
    if kind in SPLIT_EXCHANGES and getattr(op, "phase", None) is not None:
        _split_exchange(b, schedule, name, index, op, world, tracked)
    elif kind in ("all_gather", "all_to_all"):
        reads(_as_list(op.src), 0)
        stores(_as_list(op.dst), (_partition(schedule, op), b.rank))
        _cast_scale(op, schedule, reads, stores, b.rank, axes)
        exchange()
    elif kind in ("reduce_scatter", "all_reduce"):  # all_reduce: whole src, same sync
        via = _as_list(op.via) or [f"{name}_recv"]  # reduce: lse: [o_recv, lse_recv]
        reads(_as_list(op.src), 0)
        stores(via, (("index", 0, 0, axes), b.rank))
        exchange()
        reads(via + masks, 1)
        writes([op.dst] + _as_list(getattr(op, "return_lse", None)), 1)
    elif kind == "reduce":  # exact: pushes into the root's via only, which only it reads
        via = op.via or f"{name}_recv"
        root = _team(b.rank, world, axes)[op.root]  # root: a member index of the team
        reads([op.src], 0)
        if via in tracked:
            b.access(name, index, 0, via, "write", owner=root,
                     part=(("index", 0, 0, axes), b.rank))
        exchange()
        if b.rank == root:
            reads([via], 1)
        writes([op.dst], 1)
    elif kind == "broadcast":  # exactly what the kernel does: only the root stores, all of dst
        reads([op.src], 0)
        if b.rank == _team(b.rank, world, axes)[op.root]:
            stores([op.dst], None)
        exchange()
    elif kind == "all_to_all_combine":
        reads(op.src, 0)
        stores(op.via, (("index", 0, 0, axes), b.rank))
        exchange()
        reads(list(op.via) + masks, 1)
        others = [o for item in schedule.steps for n, o in item.items() if n != name]
        if not any(set(op.via) & _named(o) for o in others):
            reads(op.src, 1)  # the merge reads this rank's own part from src
        writes([op.dst] + _as_list(op.return_lse), 1)
    elif kind in ("lse_combine", "lse_correct"):
        reads(list(op.src) + masks, 0)
        writes([op.dst] + _as_list(op.return_lse), 0)
    elif kind == "copy":
        reads([op.src], 0)
        writes([op.dst], 0)
    elif kind == "external":
        reads(op.reads, 0)
        writes(op.writes, 0)
    elif kind == "ragged_all_to_all":  # writes block `rank` of every peer's dst, any count
        rows, counts = _ragged_parts(op, axes)
        reads(_as_list(op.src) + [op.counts] + _as_list(op.index), 0)
        stores(_as_list(op.dst), (rows, b.rank))
        stores([op.recv_counts], (counts, b.rank))
        _cast_scale(op, schedule, reads, stores, b.rank, axes, rows)
        exchange()
        reads([op.recv_counts], 1)  # the receiver's over-capacity check reads every count
    elif kind == "weighted_combine":  # local: its rows, weights and index, then dst
        reads(list(op.src) + _as_list(op.index), 0)
        writes([op.dst], 0)
    elif kind == "pull":  # a remote read: after its wait, every member's whole src
        exchange()
        if op.src in tracked:
            for target in _team(b.rank, world, axes):
                b.access(name, index, 1, op.src, "read", owner=target)
        writes([op.dst], 1)
    elif kind == "barrier":
        exchange()
    elif kind == "signal":
        one = _one_peer(op, b.rank, world, axes, 1)
        for peer in _peers(op.to.value, b.rank, world, axes) if one is None else one:
            b.add(name, index, 0, signal=(f"{op.channel}@{name}", peer))
    elif kind == "wait":
        found = _polls(schedule).get(name)
        polled = found.name if found is not None else "?"
        one = _one_peer(op, b.rank, world, axes, -1)
        for peer in _peers(op.from_.value, b.rank, world, axes) if one is None else one:
            b.add(name, index, 1, wait=(f"{op.channel}@{polled}", peer))
    elif kind == "shift":
        _shift(b, schedule, name, index, op, world, tracked)
    else:
        raise AssertionError(f"oracle does not know op {kind}")


def _ragged_parts(op, axes) -> tuple[tuple, tuple]:
    """The partitions a ragged_all_to_all's stores cover (dst's rows, recv_counts): index
    `rank` of dim 0, or in a grouped dispatch (dst [G, W*C], recv_counts [G, W]) block
    `rank` of dim 1 and index `rank` of dim 1."""
    if getattr(op, "groups", None) is not None and op.direction == "dispatch":
        return ("block", 1, 0, axes), ("index", 1, 0, axes)
    return ("index", 0, 0, axes), ("index", 0, 0, axes)


def _cast_scale(op, schedule: Schedule, reads, stores, rank: int, axes, rows=None) -> None:
    """A cast's scale buffer: a per-token cast into fp8 sends its row scales along (a
    store into block `rank`, its member index in a team, of every team peer's, as the
    rows land: ``rows``), any other cast reads them here."""
    scale = getattr(op, "scale", None)
    if scale is None:
        return
    if scale.per == "token" and schedule.buffers[_as_list(op.dst)[0]].dtype.value == "fp8e4m3":
        stores([scale.buffer], (rows or ("index", 0, 0, axes), rank))
    else:
        reads([scale.buffer], 0)


def build(schedule: Schedule, world: int, calls: int | None = None,
          chain_waits: bool = True) -> nx.DiGraph:
    """The full unrolled event graph: program order and signal -> wait edges.

    Waits that no signal satisfies get the attribute ``unmatched=True``.
    ``chain_waits`` False: a ``wrap: false`` or ``perm:`` shift's wait orders nothing
    (no edge into it), the rule the rotation-symmetric checker takes documented
    (docs/hb-checker.md); its accesses stay exact.
    """
    slots = schedule.slots
    calls = 2 * slots if calls is None else calls
    per_slot = schedule.streams.value == "per_slot"
    # a persistent buffer, local too: one instance per rank for all slots and calls
    tracked = {n for n, buf in schedule.buffers.items()
               if buf.symmetric or buf.shared or buf.persist}
    steps = [(n, op) for item in schedule.steps for n, op in item.items()]
    for n, op in steps:
        if op.op in ("reduce_scatter", "all_reduce", "reduce") and op.via is None:
            tracked.add(f"{n}_recv")
    # what each step's method returns (the plan's one definition): the engine reads it
    # at the return, after the step's own accesses
    from dcpc.codegen.lower import lower

    returns = {s.name: list(s.returns) for s in lower(schedule, [world]).steps}
    graph = nx.DiGraph()
    ids = count()
    per_call: dict[tuple[int, int], list[int]] = {}
    for rank in range(int(world)):
        for call in range(calls):
            b = _Builder(graph, ids, rank, call, slots, chain_waits)
            for index, (name, op) in enumerate(steps):
                if _runs(schedule, op, rank, world):  # a when: that fails: no accesses
                    _lower_step(b, schedule, name, index, op, world, tracked)
                # but its method is called there too and returns what the buffer holds,
                # which the engine reads (issue 33 flaky23)
                for n in returns[name]:
                    if n in tracked:
                        b.access(name, index, 1, n, "read", returned=True)
            per_call[(rank, call)] = b.nodes
            graph.add_edges_from(zip(b.nodes, b.nodes[1:], strict=False))
    for rank in range(int(world)):
        for call in range(calls):
            before = call - (slots if per_slot else 1)
            if before >= 0 and per_call[(rank, before)] and per_call[(rank, call)]:
                graph.add_edge(per_call[(rank, before)][-1], per_call[(rank, call)][0])
    for call in range(calls):
        sent: dict[tuple[str, int, int], list[int]] = {}
        waiting: dict[tuple[str, int, int], list[int]] = {}
        for rank in range(int(world)):
            for node in per_call[(rank, call)]:
                data = graph.nodes[node]
                if "signal" in data:
                    channel, target = data["signal"]
                    sent.setdefault((channel, rank, target), []).append(node)
                if "wait" in data:
                    channel, source = data["wait"]
                    waiting.setdefault((channel, source, rank), []).append(node)
        for link, waits in waiting.items():
            signals = sent.get(link, [])
            assert len(signals) <= 1  # a step signals each peer once per call
            for node in waits:  # every wait polling that slot sees that one signal
                if signals:
                    graph.add_edge(signals[0], node)
                else:
                    graph.nodes[node]["unmatched"] = True
    return graph


def _runs(schedule: Schedule, op, rank: int, world) -> bool:
    """Whether a step runs on ``rank``: its ``when:`` evaluated on that rank's own
    values (its index, W, the integer sizes, its mesh coordinates and axis sizes)."""
    text = getattr(op, "when", None)
    if text is None:
        return True
    env = {k: v for k, v in schedule.sizes.items() if isinstance(v, int)}
    env.update(rank=rank, W=int(world))
    if schedule.mesh:
        shape = _shape(world)
        for (axis, size), coord, n in zip(schedule.mesh.items(), _coords(rank, shape), shape,
                                          strict=True):
            env[axis] = coord
            if isinstance(size, str):
                env[size] = n
    return holds(parse_condition(text), env)


def _channel(channel: str) -> str:
    return channel.removeprefix("step:").split("@", 1)[0]


def _named(op) -> set[str]:
    """Every buffer an op names (what it may read)."""
    names: set[str] = set()
    for key in ("src", "via", "reads", "counts", "index"):
        names |= set(_as_list(getattr(op, key, None)))
    if getattr(op, "mask_empty", None) is not None:
        names |= {op.mask_empty.seq_lens, op.mask_empty.query_start_loc}
    return names


def _overlap(a: dict, b: dict, world=None) -> bool:
    """Whether accesses a and b (nodes) of one instance overlap: stores of one partition
    only for one writer; a local access of chunk j along axis d (``b[s][j]``) and a store
    of partition index along d only where the writer's member index in the owner's team
    is j; anything else always."""
    for x, y in ((a, b), (b, a)):
        if x.get("chunk") is not None and x["part"] is None and y["part"] is not None:
            partition, writer = y["part"]
            if (partition[0] == "index" and partition[1] == x["chunk"][0]
                    and world is not None):
                team = _team(writer, world, partition[3])
                return team.index(writer) == x["chunk"][1]
    if a["part"] is None or b["part"] is None:
        return True
    (pa, wa), (pb, wb) = a["part"], b["part"]
    return pa != pb or wa == wb


def oracle_keys(schedule: Schedule, world: int, calls: int | None = None,
                chain_waits: bool = True) -> set[Key]:
    """Every (kind, class, buffer, step, step) the brute force finds for group size W
    (``chain_waits``: ``build``'s)."""
    graph = build(schedule, world, calls, chain_waits)
    keys: set[Key] = set()
    roots = [n for n, d in graph.nodes(data=True) if d.get("unmatched")]
    for node in roots:
        d = graph.nodes[node]
        keys.add(("deadlock", "no-signal", _channel(d["wait"][0]), d["step"], ""))
    cyclic: set[int] = set()
    for scc in nx.strongly_connected_components(graph):
        if len(scc) < 2:
            continue
        cyclic |= scc
        for node in scc:
            d = graph.nodes[node]
            if "wait" not in d:
                continue
            for pred in graph.predecessors(node):
                if pred in scc and "signal" in graph.nodes[pred]:
                    keys.add(("deadlock", "cycle", _channel(d["wait"][0]), d["step"],
                              graph.nodes[pred]["step"]))
    blocked = set(roots) | cyclic
    for node in list(blocked):
        blocked |= nx.descendants(graph, node)
    live = graph.subgraph(n for n in graph if n not in blocked)
    order = list(nx.topological_sort(live))
    bit = {n: 1 << i for i, n in enumerate(order)}
    ancestors: dict[int, int] = {}
    for n in order:  # full transitive closure: a bitset of every ancestor
        mask = 0
        for p in live.predecessors(n):
            mask |= ancestors[p] | bit[p]
        ancestors[n] = mask
    landed = {(d["rank"], d["call"], d["index"]): n for n, d in graph.nodes(data=True)
              if d.get("landing")}

    def end(n: int) -> int | None:
        """Where an access ends: itself, or a shift's store at its owner's landing wait."""
        d = graph.nodes[n]
        if d.get("lands") is None:
            return n
        return landed.get((d["owner"], d["call"], d["lands"]))

    slots = schedule.slots
    instances: dict[tuple, list[int]] = {}
    for n in order:
        d = live.nodes[n]
        if "buffer" not in d:
            continue
        buf = schedule.buffers.get(d["buffer"])
        slot = None if buf is not None and (buf.shared or buf.persist) else d["call"] % slots
        instances.setdefault((d["buffer"], d["owner"], slot), []).append(n)
    for (buffer, _, _), nodes in instances.items():
        for i, x in enumerate(nodes):
            for y in nodes[i + 1:]:
                dx, dy = live.nodes[x], live.nodes[y]
                if dx["kind"] == "read" and dy["kind"] == "read" or not _overlap(dx, dy, world):
                    continue
                # one ends before the other starts (a store in flight ends where it lands)
                ex, ey = end(x), end(y)
                if (ex in bit and ancestors[y] & bit[ex]) or (ey in bit and ancestors[x] & bit[ey]):
                    continue
                cls, first, second = _classify(dx, dy)
                keys.add(("race", cls, buffer, first, second))
    return keys


def oracle_unwritten(schedule: Schedule, world: int) -> set[Key]:
    """Reads of a symmetric instance that no write of the same call reaches earlier in
    the data flow, on any rank (a step's in-place update of one, its write in the same
    phase as its read, does not count: the module's buffer held nothing of the call): one
    key per buffer, at its first such read. The data flow's place of a write is its
    step (a shift's store: the wait that lands it), before the signal or after the wait."""
    graph = build(schedule, world, 1)
    writes: dict[tuple, list[tuple]] = {}
    reads = []
    for _, d in graph.nodes(data=True):
        buf = schedule.buffers.get(d.get("buffer"))
        if "buffer" not in d or buf is not None and buf.persist:
            continue  # a persistent buffer's read before a write reads the call before
        place = _intended(d)[1:3]
        if d["kind"] == "write":
            writes.setdefault((d["buffer"], d["owner"]), []).append(place)
        elif not d.get("returned"):
            reads.append((place, d))
    first: dict[str, tuple] = {}
    for place, d in sorted(reads, key=lambda item: item[0]):
        done = writes.get((d["buffer"], d["owner"]), [])
        if any(w < place for w in done):
            continue
        first.setdefault(d["buffer"], ("read-before-write", "", d["buffer"], d["step"], ""))
    return set(first.values())


def _intended(d: dict) -> tuple:
    """(call, step index, phase, rank): where the data flow places an access; a store
    that lands at a later wait, at that wait (after it)."""
    if d.get("lands") is not None:
        return (d["call"], d["lands"], 1, d["rank"])
    return (d["call"], d["index"], d["phase"], d["rank"])


def _classify(dx: dict, dy: dict) -> tuple[str, str, str]:
    """(class, first step, second step), ordered by (call, step, phase) then rank."""

    intended = _intended
    first, second = sorted((dx, dy), key=intended)
    if first["kind"] == "write" and second["kind"] == "write":
        cls = "write-after-write"
    else:
        write, read = (first, second) if first["kind"] == "write" else (second, first)
        cls = ("write-after-read" if intended(write)[:3] > intended(read)[:3]
               else "read-after-write")
    return cls, first["step"], second["step"]


# --- random schedules for the property tests -----------------------------------------

RANDOM_HEADER = """\
schedule: random_{seed}
slots: {slots}
streams: {streams}
sizes:
  N: 4
  K: {{multiple_of: W}}
buffers:
  x:    {{shape: [N, K], dtype: f32}}
  y:    {{shape: [N, K], dtype: f32}}
  y_rs: {{shape: [N, K/W], dtype: f32}}
  z:    {{shape: [W*N, K], dtype: f32}}
  g0:   {{shape: [W*N, K], dtype: f32, symmetric: true{g0}}}
  g1:   {{shape: [W*N, K], dtype: f32, symmetric: true{g1}}}
  a0:   {{shape: [W, N, K/W], dtype: f32, symmetric: true{a0}}}
  s0:   {{shape: [N, K], dtype: f32, symmetric: true{s0}}}
  r0:   {{shape: [W, N, K/W], dtype: f32, symmetric: true{r0}}}
  v0:   {{shape: [W, N, K], dtype: f32, symmetric: true{v0}}}
  c0:   {{shape: [W*N, K/W], dtype: f32, symmetric: true{c0}}}
steps:
"""

PARTNERS = {"all": "all", "next": "prev", "prev": "next"}


def random_schedule_text(draw, st, root_reads: bool = False) -> str:
    """A small, structurally valid random schedule (YAML text), drawn with hypothesis.

    ``draw`` is hypothesis' draw function and ``st`` its strategies module. Steps
    are gathers, all-to-alls, reduce-scatters, copies, external reads/writes of
    what was written before, barriers, and split-phase signal/wait pairs (several
    on one channel, rings both ways) whose wait may come before its signal (a
    deadlock). ``root_reads``: externals may also read a reduce's ``via``, which only
    its root's instance holds (read-before-write elsewhere unless written before).
    """
    slots = draw(st.integers(1, 3))
    streams = draw(st.sampled_from(["per_slot", "single"]))
    flags = {b: ", shared: true" if draw(st.integers(0, 3)) == 0 else ""
             for b in ("g0", "g1", "a0", "s0", "r0", "v0", "c0")}
    steps: list[str] = []
    written: list[str] = []
    pending_waits: list[str] = []
    count_steps = draw(st.integers(1, 6))
    for _ in range(count_steps):
        kind = draw(st.sampled_from(
            ["gather", "gather", "a2a", "ext", "ext", "ext", "barrier", "sync", "rs", "copy",
             "ar", "bc", "rd"] + ["rd", "ext"] * root_reads))
        if kind == "gather":
            dst = draw(st.sampled_from(["g0", "g1"]))
            extra = ", interleave: 1" if draw(st.booleans()) else ""
            steps.append(f"{{op: all_gather, src: x, dst: {dst}, dim: 0{extra}}}")
            written.append(dst)
        elif kind == "a2a" and draw(st.booleans()):  # split/concat: dst has src's rank
            steps.append("{op: all_to_all, src: x, dst: c0, split_dim: 1, concat_dim: 0}")
            written.append("c0")
        elif kind == "a2a":
            steps.append("{op: all_to_all, src: x, dst: a0, dim: 1}")
            written.append("a0")
        elif kind == "rs":
            via = ", via: r0" if draw(st.booleans()) else ""
            steps.append(f"{{op: reduce_scatter, src: x, dst: y_rs, dim: 1{via}}}")
            if via:
                written.append("r0")
        elif kind == "ar":
            via = ", via: v0" if draw(st.booleans()) else ""
            steps.append(f"{{op: all_reduce, src: x, dst: y{via}}}")
            if via:
                written.append("v0")
        elif kind == "rd":  # the checker over-approximates (every rank's via); this is exact
            via = ", via: v0" if root_reads or draw(st.booleans()) else ""
            # one root: two roots' pushes into one via are disjoint in fact, but overlap in
            # the checker's model (a false race, the sound direction; tests/ops/test_reduce.py)
            steps.append(f"{{op: reduce, src: x, dst: y, root: 0{via}}}")
            if via and root_reads:
                written.append("v0")
        elif kind == "bc":  # the checker's model over-approximates; this oracle's is exact
            steps.append(f"{{op: broadcast, src: x, dst: s0, root: {draw(st.integers(0, 1))}}}")
            written.append("s0")
        elif kind == "copy" and "g0" in written:
            steps.append("{op: copy, src: g0, dst: z}")
        elif kind == "barrier":
            steps.append("{op: barrier}")
        elif kind == "sync":
            to = draw(st.sampled_from(["all", "next", "prev"]))
            order = draw(st.sampled_from(["split", "split", "wait-first", "later", "both"]))
            # one channel family per pairing, so that each wait polls the signal it is
            # drawn with (mixing `to: all` and `to: next` on one channel is refused as
            # ambiguous: unpolled-signal)
            family = "b" if order == "both" else "c" if to == "all" else "r"
            channel = f"{family}{draw(st.integers(0, 1))}"
            signal = f"{{op: signal, to: {to}, channel: {channel}}}"
            wait = f"{{op: wait, from: {PARTNERS[to]}, channel: {channel}}}"
            if order == "wait-first":
                steps += [wait, signal]
            elif order == "both":  # one signal to all polled by a wait from each side
                steps += [f"{{op: signal, to: all, channel: {channel}}}",
                          f"{{op: wait, from: prev, channel: {channel}}}",
                          f"{{op: wait, from: next, channel: {channel}}}"]
            elif order == "later":
                steps.append(signal)
                pending_waits.append(wait)
            else:
                steps += [signal, wait]
        else:
            reads = sorted(set(draw(st.lists(st.sampled_from(written), max_size=2)))) \
                if written else []
            if root_reads and "v0" in written and draw(st.booleans()):
                reads = sorted(set(reads) | {"v0"})
            target = draw(st.sampled_from(["y", "s0", "g0", "s0"]))
            if target == "g0" and "g0" not in written:
                target = "s0"
            steps.append(f"{{op: external, reads: [{', '.join(reads + ['x'])}], "
                         f"writes: [{target}]}}")
            if target != "y":
                written.append(target)
        if pending_waits and draw(st.booleans()):
            steps.append(pending_waits.pop())
    steps += pending_waits
    if not steps:
        steps.append("{op: barrier}")
    body = "".join(f"  - t{i}: {s}\n" for i, s in enumerate(steps))
    return RANDOM_HEADER.format(seed=draw(st.integers(0, 999)), slots=slots,
                                streams=streams, **flags) + body


# --- shift (point-to-point): written here from the language's words, not the checker's ---

def _shift_offset(op) -> int:
    return {"next": 1, "prev": -1}.get(op.offset, op.offset)


def _shift_puts(schedule: Schedule) -> dict[str, str]:
    """wait step -> the put it polls: the k-th `phase: wait` of a (src, dst, offset,
    wrap) polls the k-th `phase: put` of it, before it or after it (a wait written first:
    the pipeline stage's receive, compute, send), and lands its data."""
    puts: dict[tuple, list[str]] = {}
    waits: dict[tuple, list[str]] = {}
    for item in schedule.steps:
        for n, op in item.items():
            if op.op != "shift" or op.phase is None:
                continue
            key = (op.src, op.dst, _shift_offset(op), op.wrap, str(op.perm))
            (puts if op.phase == "put" else waits).setdefault(key, []).append(n)
    return {w: p for key, ws in waits.items()
            for w, p in zip(ws, puts.get(key, []), strict=False)}


def _shift(b: _Builder, schedule: Schedule, name: str, index: int, op, world: int,
           tracked: set[str]) -> None:
    """Rank r stores src into rank r + k's whole dst (a part of its own: writer r), then
    signals r + k; the wait (its own, or in the matching `phase: wait` step) is for r - k.
    `wrap: false`: r + k and r - k are ranks only inside 0 .. W-1, no mod: a rank with no
    r + k stores and signals nothing, a rank with no r - k does not wait (the template's
    launch masks that lane off) and its dst is not written.
    `axis: a` on a mesh: r, r + k and W are read in r's team (the ranks sharing every
    coordinate off axis a, in rank order): r + k is the team's member at r's position
    plus k, and the team's size replaces W."""
    k = _shift_offset(op)
    axes = _axes(schedule, op)
    team = _team(b.rank, world, axes)
    me, size = team.index(b.rank), len(team)
    if op.perm is not None:
        # perm (the destination of each rank after unrolling, -1: none): r stores into
        # perm[r] and waits for the rank whose destination is r; none: itself stands in
        dests = list(op.perm)
        target = dests[b.rank] if dests[b.rank] >= 0 else None
        source = dests.index(b.rank) if b.rank in dests else b.rank
        k = ("perm", tuple(dests))  # the partition: one per table
    elif op.wrap:
        target, source = team[(me + k) % size], team[(me - k) % size]
    else:  # past an end: no peer; the rank itself stands in (no signal, no wait below)
        target = team[me + k] if 0 <= me + k < size else None
        source = team[me - k] if 0 <= me - k < size else b.rank
    if op.phase != "wait" and target is not None:
        # the language writes dst at the wait: the put's own, or the `phase: wait` step
        # that polls this put
        landing = index
        if op.phase == "put":
            waits = {put: wait for wait, put in _shift_puts(schedule).items()}
            landing = next(i for i, item in enumerate(schedule.steps)
                           if waits.get(name) in item)
        if op.src in tracked:
            b.access(name, index, 0, op.src, "read")
        if op.dst in tracked:
            b.access(name, index, 0, op.dst, "write", owner=target,
                     part=(("peer", k, axes), b.rank), lands=landing)
        if target != b.rank:
            b.add(name, index, 0, signal=("step:" + name, target))
    if op.phase != "put":
        polled = name if op.phase is None else _shift_puts(schedule).get(name, "?")
        if source != b.rank and (b.chain_waits or (op.perm is None and op.wrap)):
            b.add(name, index, 1, wait=("step:" + polled, source))
        elif source != b.rank:  # the model's chain wait: no edge, the node kept
            b.add(name, index, 1)
        b.add(name, index, 1, landing=True)  # the data that was in flight lands here


def _expression(size) -> str:
    """A size expression, whatever its spacing and outer parentheses (Python's own
    parser: this oracle does not ask the checker's)."""
    return _parsed(str(size).strip())


@lru_cache(maxsize=4096)
def _parsed(text: str) -> str:
    return ast.dump(ast.parse(text, mode="eval").body)


SPLIT_EXCHANGES = ("ragged_all_to_all", "all_gather", "all_to_all", "reduce_scatter")


def _split_key(op) -> tuple:
    """What a `phase: wait` names as the put it polls: the payloads (one name or a list
    alike) and axis, and a ragged's counts, recv_counts, capacity (as an expression:
    `N*C` is `(N * C)`), scale buffer, groups and direction, an all_gather's dim and interleave, an
    all_to_all's dim, split_dim and concat_dim, a reduce_scatter's dim, via and
    output_scale."""
    if op.op == "all_gather":
        extra = (op.dim, op.interleave)
    elif op.op == "all_to_all":
        extra = (op.dim, op.split_dim, op.concat_dim)
    elif op.op == "reduce_scatter":
        extra = (op.dim, op.via, op.output_scale)
    else:
        extra = (op.counts, op.recv_counts, op.index, _expression(op.capacity),
                 op.scale.buffer if op.scale is not None else None,
                 _expression(op.groups) if op.groups is not None else None, op.direction,
                 getattr(op, "offset", None))
    return (op.op, tuple(_as_list(op.src)), tuple(_as_list(op.dst)), *extra, str(op.axis))


def _per_schedule(build: Callable[[Schedule], T]) -> Callable[[Schedule], T]:
    """``build`` asked once per schedule object (a build of the oracle asks the pairings
    for every split step and wait of every rank): the last schedule's answer is kept."""
    last: list[tuple[Schedule, T]] = []

    @wraps(build)
    def cached(schedule: Schedule) -> T:
        if not last or last[0][0] is not schedule:
            last[:] = [(schedule, build(schedule))]
        return last[0][1]
    return cached


@_per_schedule
def _polls(schedule: Schedule) -> dict:
    """wait step -> the signal step it polls (dcpc.lang.semantics.channels)."""
    return channels(schedule).polls


@_per_schedule
def _exchange_puts(schedule: Schedule) -> dict[str, str]:
    """wait step -> the put it polls: the k-th `phase: wait` of a split exchange
    (SPLIT_EXCHANGES) with a key (`_split_key`) polls the k-th `phase: put` of it
    written before it."""
    return _pair_puts(schedule)


def _pair_puts(schedule: Schedule) -> dict[str, str]:
    puts: dict[tuple, list[str]] = {}
    out = {}
    for item in schedule.steps:
        for n, op in item.items():
            if op.op not in SPLIT_EXCHANGES or op.phase is None:
                continue
            key = _split_key(op)
            if op.phase == "put":
                puts.setdefault(key, []).append(n)
            elif puts.get(key):
                out[n] = puts[key].pop(0)
    return out


def _split_exchange(b: _Builder, schedule: Schedule, name: str, index: int, op, world: int,
                    tracked: set[str]) -> None:
    """A split ragged_all_to_all, all_gather, all_to_all or reduce_scatter: the put reads
    its payloads (a ragged's counts too) and stores its part (block `rank`; the op's
    partition) of every team member's dst (and recv_counts; a reduce_scatter's via, its
    implicit one named after the put), landing at the wait that polls it, and signals
    every member; the wait waits for every member's put, lands what they pushed, then a
    ragged's reads every count (the receiver's over-capacity check), a reduce_scatter
    reads its via and writes dst (the sum)."""
    axes = _axes(schedule, op)
    team = _team(b.rank, world, axes)
    ragged, summed = op.op == "ragged_all_to_all", op.op == "reduce_scatter"
    # a ragged_all_to_all by offset: its put stores into member rank + k only (itself at
    # k = 0 mod its team's size) and signals it, its wait polls member rank - k
    one = ragged and getattr(op, "offset", None) is not None
    to, back = ((_one_peer(op, b.rank, world, axes, 1), _one_peer(op, b.rank, world, axes, -1))
                if one else (None, None))
    if one:
        found = team[(team.index(b.rank) + op.offset) % len(team)]
        team = [found]
    rows, counts = _ragged_parts(op, axes) if ragged else (_partition(schedule, op), None)
    part = (rows, b.rank)
    if op.phase == "put":
        waits = {w for w, p in _exchange_puts(schedule).items() if p == name}
        landing = next((i for i, item in enumerate(schedule.steps) if waits & set(item)), None)
        assert landing is not None, (
            f"brute force: put '{name}' has no later 'phase: wait' {op.op} with "
            "the same src, dst, counts, recv_counts, capacity, scale and axis (the "
            "checker's unmatched-put: a schedule the oracles are not asked about)")

        def reads(names, phase):
            for n in names:
                if n in tracked:
                    b.access(name, index, phase, n, "read")

        def stores(names, part):  # every store of the put lands at its wait
            for n in names:
                for target in team if n in tracked else ():
                    b.access(name, index, 0, n, "write", owner=target, part=part,
                             lands=landing)

        reads(_as_list(op.src) + ([op.counts, *_as_list(op.index)] if ragged else []), 0)
        into = [op.via or f"{name}_recv"] if summed else _as_list(op.dst)
        stores(into, part)
        if ragged:
            stores([op.recv_counts], (counts, b.rank))
            _cast_scale(op, schedule, reads, stores, b.rank, axes, rows)
        for peer in _peers("all", b.rank, world, axes) if to is None else to:
            b.add(name, index, 0, signal=("step:" + name, peer))
        return
    polled = _exchange_puts(schedule).get(name, "?")
    for peer in _peers("all", b.rank, world, axes) if back is None else back:
        b.add(name, index, 1, wait=("step:" + polled, peer))
    b.add(name, index, 1, landing=True)  # the data that was in flight lands here
    if ragged and not one and op.recv_counts in tracked:
        b.access(name, index, 1, op.recv_counts, "read")
    for n, kind in ([(op.via or f"{polled}_recv", "read"), (op.dst, "write")] if summed else []):
        if n in tracked:
            b.access(name, index, 1, n, kind)


def shift_header(name: str, seed: int, slots: int, streams: str, *,
                 local: tuple[str, ...] = ("x", "y"), h0: str = "", h1: str = "",
                 gather: bool = True, steps: tuple[str, ...] = ()) -> str:
    """The header of the shift generators' schedules (random_shift_schedule_text,
    random_wait_first_schedule_text): the local buffers ``local``, the symmetric h0 and
    h1 the shifts move between (``h0``/``h1``: their extra keys, e.g. ", shared: true"),
    with ``gather`` the gathers' g0, and the first ``steps`` ("name: {op ...}")."""
    lines = [f"schedule: {name}_{seed}", f"slots: {slots}", f"streams: {streams}",
             "sizes:", "  N: 4", "  K: 2", "buffers:"]
    lines += [f"  {b}:  {{shape: [N, K], dtype: f32}}" for b in local]
    lines += [f"  {b}: {{shape: [N, K], dtype: f32, symmetric: true{extra}}}"
              for b, extra in (("h0", h0), ("h1", h1))]
    if gather:
        lines.append("  g0: {shape: [W*N, K], dtype: f32, symmetric: true}")
    return "\n".join([*lines, "steps:", *(f"  - {step}" for step in steps)]) + "\n"


# perms (a shift's `perm:`) valid at every W: the mirror, a rotation by 2 (every rank a
# fixed point at W=2), the half rotation (by (W + 1) / 2 at odd W), the negation (rank 0
# fixed), swapped pairs (partial at odd W: the last rank sends nothing and receives
# nothing) and a line (partial: rank 0 gets none)
FULL_PERMS = ("W - 1 - r", "(r + 2) % W", "(r + (W + W % 2) / 2) % W", "(W - r) % W")
PARTIAL_PERMS = ("r + 1 - 2 * (r % 2)", "r + 1")


def random_shift_schedule_text(draw, st, nowrap: bool = False, perm: bool = False) -> str:
    """A small, structurally valid random schedule of shifts (whole, or put ... wait with
    steps in between, several puts in flight whose waits come in put order or not),
    externals that read and write the shifted buffers (also while a put into them is in
    flight), gathers into another buffer, barriers and split-phase credits (signal/wait
    next/prev). A put's dst counts as written at its wait, where the language lands it.
    ``nowrap``: some shifts are `wrap: false`, whose dst does not count as written (the
    first ranks of the line receive nothing). ``perm``: most shifts take a `perm:`
    (FULL_PERMS, PARTIAL_PERMS; a partial one's dst does not count as written)."""
    slots = draw(st.integers(1, 2))
    streams = draw(st.sampled_from(["per_slot", "single"]))
    flags = {b: ", shared: true" if draw(st.integers(0, 4)) == 0 else "" for b in ("h0", "h1")}
    steps: list[str] = []
    pending: list[tuple[str, str]] = []  # (a put's wait, its dst)
    written: list[str] = []  # symmetric buffers a step wrote (read-before-write)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["shift", "shift", "put", "ext", "ext", "barrier", "credit",
                                     "gather"]))
        src = draw(st.sampled_from(["x"] + [b for b in ("h0", "h1") if b in written]))
        dst = draw(st.sampled_from([b for b in ("h0", "h1") if b != src]))
        wrap = not (nowrap and draw(st.booleans()))
        offset = draw(st.sampled_from(["next", "prev", "1", "-1", "2", "-2", "3"]))
        text = ""
        if perm and draw(st.integers(0, 3)):
            text = draw(st.sampled_from(FULL_PERMS + PARTIAL_PERMS))
            wrap = text in FULL_PERMS  # a partial perm leaves some ranks' dst unwritten
        if kind == "shift" and wrap:
            written.append(dst)
        move = f"offset: {offset}" + ("" if wrap else ", wrap: false")
        if perm and text:
            move = f'perm: "{text}"'

        if kind == "shift":
            steps.append(f"{{op: shift, src: {src}, dst: {dst}, {move}}}")
        elif kind == "put":
            steps.append(f"{{op: shift, src: {src}, dst: {dst}, {move}, phase: put}}")
            pending.append((f"{{op: shift, src: {src}, dst: {dst}, {move}, "
                            "phase: wait}", dst if wrap else ""))
        elif kind == "barrier":
            steps.append("{op: barrier}")
        elif kind == "gather" and "h0" in written:
            steps.append("{op: all_gather, src: h0, dst: g0, dim: 0}")
            written.append("g0")
        elif kind == "credit":
            to = draw(st.sampled_from(["next", "prev"]))
            channel = f"c{draw(st.integers(0, 1))}"
            back = PARTNERS[to]
            pair = [f"{{op: signal, to: {to}, channel: {channel}}}",
                    f"{{op: wait, from: {back}, channel: {channel}}}"]
            steps += pair if draw(st.integers(0, 4)) else pair[::-1]
        elif kind == "ext":
            reads = sorted(set(draw(st.lists(st.sampled_from(["h0", "h1", "g0"]), max_size=2))))
            reads = [b for b in reads if b in written]
            target = draw(st.sampled_from(["y", "h0", "h1"]))
            written.append(target)
            steps.append(f"{{op: external, reads: [{', '.join(reads + ['x'])}], "
                         f"writes: [{target}]}}")
        while pending and draw(st.booleans()):  # the oldest put's wait, or the newest's
            wait, landed = pending.pop(draw(st.sampled_from([0, -1])))
            steps.append(wait)
            written.append(landed)  # "" for a put without wrap: not written everywhere
    if draw(st.booleans()):
        pending.reverse()
    steps += [wait for wait, _ in pending]
    if not steps:
        steps.append("{op: barrier}")
    body = "".join(f"  - t{i}: {s}\n" for i, s in enumerate(steps))
    return shift_header("shift", draw(st.integers(0, 999)), slots, streams, **flags) + body



# sym26: shifts whose src read is partial (wrap: false, partial perms), beside stores into
# their src buffers that may land on the ranks that send nothing
SRC_READ_MOVES = ("offset: 1, wrap: false", "offset: -1, wrap: false",
                  "offset: 2, wrap: false", "offset: 3, wrap: false", 'perm: "r + 1"',
                  'perm: "r + 1 - 2 * (r % 2)"', 'perm: "r + 3"', 'perm: "W - 2 - r"')
SRC_STORE_MOVES = SRC_READ_MOVES + ("offset: 1", "offset: -1", "offset: 2",
                                    'perm: "W - 1 - r"', 'perm: "(r + 2) % W"')


def random_src_read_schedule_text(draw, st, mesh: bool = False) -> str:
    """A random schedule whose shifts read h0/h1 as their src where they send only (a line
    or a partial perm, whole or put ... wait), beside stores into h0/h1 (any move,
    partial ones landing on some ranks only), externals, barriers and credits; ``mesh``:
    over ``mesh: {a: A, b: B}``, each shift along one axis."""
    lines = [f"schedule: src_read_{draw(st.integers(0, 999))}",
             f"slots: {draw(st.integers(1, 2))}",
             f"streams: {draw(st.sampled_from(['per_slot', 'single']))}"]
    lines += ["mesh: {a: A, b: B}"] if mesh else []
    lines += ["sizes: {N: 4, K: 2}", "buffers:", "  x:  {shape: [N, K], dtype: f32}"]
    lines += [f"  {b}: {{shape: [N, K], dtype: f32, symmetric: true{extra}}}"
              for b, extra in (("h0", ", shared: true" if draw(st.integers(0, 4)) == 0 else ""),
                               ("h1", ", shared: true" if draw(st.integers(0, 4)) == 0 else ""),
                               ("h2", ""))]
    steps = ["{op: external, reads: [x], writes: [h0]}",
             "{op: external, reads: [x], writes: [h1]}"]
    for _ in range(draw(st.integers(2, 6))):
        on = f", axis: {draw(st.sampled_from(['a', 'b']))}" if mesh else ""
        kind = draw(st.sampled_from(["read", "read", "store", "store", "ext", "barrier",
                                     "credit", "put"]))
        src = draw(st.sampled_from(["h0", "h1"]))
        other = "h1" if src == "h0" else "h0"
        if kind in ("read", "put"):
            move, dst = draw(st.sampled_from(SRC_READ_MOVES)), draw(st.sampled_from([other, "h2"]))
            shift = f"op: shift{on}, src: {src}, dst: {dst}, {move}"
            if kind == "read":
                steps.append(f"{{{shift}}}")
                continue
            steps.append(f"{{{shift}, phase: put}}")
            if draw(st.booleans()):
                steps.append(draw(st.sampled_from(["{op: external, reads: [x], writes: [h1]}",
                                                   "{op: barrier}"])))
            steps.append(f"{{{shift}, phase: wait}}")
        elif kind == "store":
            move = draw(st.sampled_from(SRC_STORE_MOVES))
            steps.append(f"{{op: shift{on}, src: x, dst: {other}, {move}}}")
        elif kind == "ext":
            steps.append(f"{{op: external, reads: [x, {src}], writes: [{other}]}}")
        elif kind == "barrier":
            steps.append("{op: barrier}")
        else:
            to = draw(st.sampled_from(["next", "prev"]))
            along = ", axis: a" if mesh else ""
            steps += [f"{{op: signal{along}, to: {to}, channel: c}}",
                      f"{{op: wait{along}, from: {PARTNERS[to]}, channel: c}}"]
    body = "".join(f"  - t{i}: {s}\n" for i, s in enumerate(steps))
    return "\n".join(lines) + "\nsteps:\n" + body

# --- hop loops (dcpc.lang.loops): random ring loops on a double buffer ---------------

LOOP_HEADER = """\
schedule: loop_{seed}
slots: {slots}
sizes:
  N: 4
  K: 2
buffers:
  x:  {{shape: [N, K], dtype: f32}}
  y:  {{shape: [N, K], dtype: f32}}
  kv: {{shape: [2, N, K], dtype: f32, symmetric: true}}
steps:
  - init: {{op: external, reads: [x], writes: ["kv[0]", "kv[1]"]}}
  - ring:
      repeat: {trip}
      as: h
      steps:
"""


def _insert_apart(draw, st, body: list[str], first: str, second: str) -> None:
    """``first`` and then ``second`` inserted into ``body`` at random places (``second``
    before ``first`` too)."""
    at_s, at_w = draw(st.integers(0, len(body))), draw(st.integers(0, len(body)))
    body.insert(at_s, first)
    body.insert(at_w + (at_w > at_s), second)


def unrolled(text: str, worlds=(2, 3, 4)):
    """(world, schedule) of ``text`` unrolled at each of ``worlds``, each asserted free
    of structural errors (a generator of valid schedules only)."""
    from dcpc.check import structural
    from dcpc.lang.parse import parse_text

    for world in worlds:
        schedule = parse_text(text, "unrolled.yaml", world)
        errors = [d for d in structural.check(schedule, [world]) if d.severity == "error"]
        assert errors == [], (text, world)
        yield world, schedule


def assert_brute_force_agrees(schedule: Schedule, world, text: str) -> None:
    """The checker's findings of ``schedule`` at ``world`` are the brute force's. Known,
    not about any one op (flat schedules show it: a barrier between a wait and the
    signal it polls): behind a deadlock the brute force also reports the knock-on
    cycles of the steps it blocks; the checker reports the cause. Races and the cause
    must still agree exactly."""
    from dcpc.check import hb

    found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
    brute = oracle_keys(schedule, world)
    if any(k[0] == "deadlock" for k in found):
        extra = brute - found
        assert found <= brute and all(k[0] == "deadlock" for k in extra), (text, world)
    else:
        assert found == brute, (text, world)


def random_loop_schedule_text(draw, st) -> str:
    """A hop loop passing a double buffer ``kv[2, N, K]`` around the ring (slice
    ``h % 2`` in hand, the other in flight, or the other way round), its block attended
    by an external step, with or without a credit (signal/wait next/prev) placed at
    random, so that races, deadlocks and correct rings all occur. Unrolled per W by the
    parser; the brute force and the execution oracle see only the unrolled steps."""
    trip = draw(st.sampled_from(["W - 1", "W - 2", "W", "1", "2"]))
    a, b = draw(st.sampled_from([("h % 2", "(h + 1) % 2"), ("(h + 1) % 2", "h % 2")]))
    offset = draw(st.sampled_from(["next", "prev"]))
    back = PARTNERS[offset]  # the credit goes back to the writer
    body = []
    if draw(st.booleans()):
        body += [f'{{op: shift, src: "kv[{a}]", dst: "kv[{b}]", offset: {offset}, phase: put}}',
                 f'{{op: external, reads: ["kv[{a}]", x], writes: [y]}}',
                 f'{{op: shift, src: "kv[{a}]", dst: "kv[{b}]", offset: {offset}, phase: wait}}']
    else:
        body += [f'{{op: external, reads: ["kv[{a}]", x], writes: [y]}}',
                 f'{{op: shift, src: "kv[{a}]", dst: "kv[{b}]", offset: {offset}}}']
    if draw(st.booleans()):  # the credit: signal the writer after the read, wait it
        _insert_apart(draw, st, body, f"{{op: signal, to: {back}, channel: free}}",
                      f"{{op: wait, from: {PARTNERS[back]}, channel: free}}")
    text = LOOP_HEADER.format(seed=draw(st.integers(0, 999)), slots=draw(st.integers(1, 2)),
                              trip=trip)
    text += "".join(f"        - s{i}: {s}\n" for i, s in enumerate(body))
    if draw(st.booleans()):
        text += '  - last: {op: external, reads: ["kv[1]"], writes: [y]}\n'
    return text
# --- random mesh schedules (two axes, ops over one axis or both) ---------------------

RANDOM_MESH_HEADER = """\
schedule: random_mesh_{seed}
slots: {slots}
streams: {streams}
mesh: {{a: A, b: B}}
sizes:
  N: 4
  K: {{multiple_of: W}}
buffers:
  x:    {{shape: [N, K], dtype: f32}}
  y:    {{shape: [N, K], dtype: f32}}
  ga:   {{shape: [A*N, K], dtype: f32, symmetric: true{ga}}}
  gb:   {{shape: [B*N, K], dtype: f32, symmetric: true{gb}}}
  gw:   {{shape: [W*N, K], dtype: f32, symmetric: true{gw}}}
  ta:   {{shape: [A, N, K/A], dtype: f32, symmetric: true{ta}}}
  tb:   {{shape: [B, N, K/B], dtype: f32, symmetric: true{tb}}}
  s0:   {{shape: [N, K], dtype: f32, symmetric: true{s0}}}
steps:
"""

TEAMS = {"a": ("a", "ga", "ta"), "b": ("b", "gb", "tb"), "ab": (None, "gw", None)}


# The mesh shapes the random mesh schedules are proved and compared at.
MESH_SHAPES = [MeshWorld(s) for s in ((2, 2), (2, 3), (3, 2))]


def random_mesh_schedule_text(draw, st, shifts: bool = False, reductions: bool = False,
                              perms: bool = False) -> str:
    """A small, structurally valid random schedule over ``mesh: {a: A, b: B}``: gathers
    and all-to-alls over axis a, b or both, barriers and signal/wait pairs over a team
    (next/prev along one axis), externals reading what was written. ``shifts``: shifts
    along axis a or b too (whole or put ... wait, any offset, with or without wrap).
    ``reductions``: all_reduce, broadcast and reduce over a team too (root: member 0 or
    1 of each team; implicit receive buffers). ``perms``: the shifts take a `perm:` (of
    FULL_PERMS: member indices along the axis, or ranks over both) half the time; such a text is one
    schedule per mesh shape (parse it at each)."""
    slots = draw(st.integers(1, 2))
    streams = draw(st.sampled_from(["per_slot", "single"]))
    flags = {b: ", shared: true" if draw(st.integers(0, 3)) == 0 else ""
             for b in ("ga", "gb", "gw", "ta", "tb", "s0")}
    steps: list[str] = []
    written: list[str] = []
    pending_waits: list[str] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["gather", "gather", "a2a", "ext", "ext", "barrier",
                                     "sync", "sync"] + ["shift", "shift"] * (shifts + 2 * perms)
                                    + ["ar", "bc", "rd"] * reductions))
        team = draw(st.sampled_from(["a", "b", "ab"]))
        axis, gdst, tdst = TEAMS[team]
        on = f", axis: {axis}" if axis else (", axis: [a, b]" if draw(st.booleans()) else "")
        if kind == "shift":
            along = draw(st.sampled_from(["a", "b"]))
            offset = draw(st.sampled_from(["next", "prev", "2", "-1"]))
            wrap = draw(st.integers(0, 2)) > 0
            offset += "" if wrap else ", wrap: false"
            if perms and draw(st.booleans()):  # along a, b or both (the whole mesh)
                offset, wrap = f'perm: "{draw(st.sampled_from(FULL_PERMS))}"', True
                along = draw(st.sampled_from([along, "[a, b]"]))
            else:
                offset = f"offset: {offset}"
            move = f"op: shift, axis: {along}, src: x, dst: s0, {offset}"
            if draw(st.booleans()):
                steps.append(f"{{{move}}}")
            else:
                steps.append(f"{{{move}, phase: put}}")
                pending_waits.append(f"{{{move}, phase: wait}}")
            if wrap:  # without wrap, the line's first ranks get no s0 from it
                written.append("s0")
        elif kind == "gather":
            steps.append(f"{{op: all_gather{on}, src: x, dst: {gdst}, dim: 0}}")
            written.append(gdst)
        elif kind == "a2a" and tdst is not None:
            steps.append(f"{{op: all_to_all{on}, src: x, dst: {tdst}, dim: 1}}")
            written.append(tdst)
        elif kind == "barrier":
            steps.append(f"{{op: barrier{on}}}")
        elif kind == "ar":
            steps.append(f"{{op: all_reduce{on}, src: x, dst: y}}")
        elif kind == "bc":
            steps.append(f"{{op: broadcast{on}, src: x, dst: s0, root: "
                         f"{draw(st.integers(0, 1))}}}")
            written.append("s0")
        elif kind == "rd":
            steps.append(f"{{op: reduce{on}, src: x, dst: y, root: {draw(st.integers(0, 1))}}}")
        elif kind == "sync":
            to = draw(st.sampled_from(["all", "next", "prev"]))
            if to != "all" and axis is None:
                axis, on = "a", ", axis: a"
            order = draw(st.sampled_from(["split", "split", "wait-first", "later"]))
            channel = f"{'c' if to == 'all' else 'r'}{team}{draw(st.integers(0, 1))}"
            signal = f"{{op: signal{on}, to: {to}, channel: {channel}}}"
            wait = f"{{op: wait{on}, from: {PARTNERS[to]}, channel: {channel}}}"
            if order == "wait-first":
                steps += [wait, signal]
            elif order == "later":
                steps.append(signal)
                pending_waits.append(wait)
            else:
                steps += [signal, wait]
        else:
            reads = sorted(set(draw(st.lists(st.sampled_from(written), max_size=2)))) \
                if written else []
            target = draw(st.sampled_from(["y", "s0"]))
            steps.append(f"{{op: external, reads: [{', '.join(reads + ['x'])}], "
                         f"writes: [{target}]}}")
            if target != "y":
                written.append(target)
        if pending_waits and draw(st.booleans()):
            steps.append(pending_waits.pop())
    steps += pending_waits
    body = "".join(f"  - t{i}: {s}\n" for i, s in enumerate(steps))
    return RANDOM_MESH_HEADER.format(seed=draw(st.integers(0, 999)), slots=slots,
                                     streams=streams, **flags) + body


# --- a shift's wait written before its put (the pipeline stage's receive, compute, send)

# how a wait-first pair moves: chains (no wrap, a line perm, swapped pairs are a cycle
# of two) and rings (every rank waits first: a deadlock the checker must report)
FIRST_MOVES = ("offset: next, wrap: false", "offset: prev, wrap: false",
               "offset: 2, wrap: false", 'perm: "r + 1"', 'perm: "(r + 1) % W"',
               "offset: next", 'perm: "r + 1 - 2 * (r % 2)"')


def random_wait_first_schedule_text(draw, st, mixed: bool = False) -> str:
    """A small random schedule with one or two shifts whose wait is written before its
    put (chains and rings; now and then two such pairs of one chain, interleaved: wait,
    wait, compute, put, put), local steps between them that read the landed dst and write
    the src (the stage's compute), and credits (signal/wait next/prev), barriers and
    externals around them, placed at random: correct pipelines, races (no credit, a
    write of the dst while a push into it may be in flight) and deadlocks (rings).
    ``mixed``: the two interleaved pairs move each its own way (two chains on the one
    axis: a forward and a backward hand-off, a line and a perm...) and their puts come
    in either order (live, or a deadlock the span's run finds)."""
    slots = draw(st.integers(1, 2))
    # two slots on their own streams around a wait-first are refused (wait-first-span)
    streams = "single" if slots == 2 else draw(st.sampled_from(["per_slot", "single"]))
    steps: list[str] = []

    def around() -> None:
        for _ in range(draw(st.integers(0, 2))):
            kind = draw(st.sampled_from(["credit", "barrier", "ext"]))
            if kind == "credit":
                to = draw(st.sampled_from(["next", "prev"]))
                channel = f"c{draw(st.integers(0, 1))}"
                pair = [f"{{op: signal, to: {to}, channel: {channel}}}",
                        f"{{op: wait, from: {PARTNERS[to]}, channel: {channel}}}"]
                steps.extend(pair if draw(st.integers(0, 4)) else pair[::-1])
            elif kind == "barrier":
                steps.append("{op: barrier}")
            else:
                target = draw(st.sampled_from(["y", "h0", "h1"]))
                steps.append(f"{{op: external, reads: [x], writes: [{target}]}}")

    def compute(dsts: list[str], srcs: list[str], most: int) -> None:
        for _ in range(draw(st.integers(0, most))):  # the stage's compute: local steps
            reads = draw(st.sampled_from([dsts, ["x"], [*dsts, "x"]]))
            writes = draw(st.sampled_from([srcs[:1], srcs[-1:], srcs]))
            steps.append(f"{{op: external, reads: [{', '.join(reads)}], "
                         f"writes: [{', '.join(writes)}]}}")

    for _ in range(draw(st.integers(1, 2))):
        around()
        move = draw(st.sampled_from(FIRST_MOVES))
        if draw(st.integers(0, 2 - mixed)) == 2 - mixed:  # two pairs, interleaved
            other = draw(st.sampled_from(FIRST_MOVES)) if mixed else move
            shifts = [f"{{op: shift, src: y, dst: h0, {move}, phase: ",
                      f"{{op: shift, src: o, dst: h1, {other}, phase: "]
            steps.extend(half + "wait}" for half in shifts)
            compute(["h0", "h1"], ["y", "o"], 2)
            first = draw(st.integers(0, 1)) if mixed else 0
            steps.append(shifts[first] + "put}")
            compute([["h1"], ["h0"]][first], [["o"], ["y"]][first], 1)  # the second's src
            steps.append(shifts[1 - first] + "put}")
            continue
        dst = draw(st.sampled_from(["h0", "h1"]))
        src = draw(st.sampled_from(["y", "o"]))
        steps.append(f"{{op: shift, src: {src}, dst: {dst}, {move}, phase: wait}}")
        compute([dst], [src], 2)
        steps.append(f"{{op: shift, src: {src}, dst: {dst}, {move}, phase: put}}")
    around()
    body = "".join(f"  - t{i}: {s}\n" for i, s in enumerate(steps))
    return shift_header("first", draw(st.integers(0, 999)), slots, streams,
                        local=("x", "y", "o"), gather=False,
                        steps=("fill: {op: external, reads: [x], writes: [h0, h1, y, o]}",)
                        ) + body


# --- random credits to one peer (signal/wait by offset or perm) ----------------------

CREDIT_HEADER = ("schedule: random_credit_{seed}\nslots: {slots}\nsizes: {{N: 4, K: 2}}\n"
                 "buffers:\n  x: {{shape: [N, K], dtype: f32}}\n"
                 "  y: {{shape: [N, K], dtype: f32}}\n"
                 "  s: {{shape: [N, K], dtype: f32, symmetric: true}}\nsteps:\n")

# a push's peer, as an offset or a perm that is one translation at every W (each with
# the offset its credit goes back by), and credits that may miss the writer
MOVES = {"offset: next": -1, "offset: prev": 1, "offset: 2": -2, "offset: -2": 2,
         'perm: "(r + 2) % W"': -2, 'perm: "(r + W - 1) % W"': 1}
CREDITS = {-1: ["offset: -1", 'perm: "(r + W - 1) % W"', "to: prev"],
           1: ["offset: 1", 'perm: "(r + 1) % W"', "to: next"],
           -2: ["offset: -2", 'perm: "(r + W - 2) % W"'], 2: ["offset: 2", 'perm: "(r + 2) % W"']}


def random_credit_schedule_text(draw, st) -> str:
    """A shift into ``s`` by an offset or a perm (one translation: the checker proves it
    exactly), its receive read by an external step, and a credit by signal/wait to one
    peer (an offset, a perm, next/prev) that goes back to the writer or to another rank,
    its signal and wait placed at random (a wait before its signal: a cycle of waits),
    so that correct credits, races and deadlocks all occur."""
    move = draw(st.sampled_from(sorted(MOVES)))
    back = draw(st.sampled_from([MOVES[move]] * 2 + [-1, 1, -2, 2]))
    credit = draw(st.sampled_from(CREDITS[back]))
    waited = credit.replace("to: next", "from: prev").replace("to: prev", "from: next")
    body = [f"{{op: shift, src: x, dst: s, {move}}}", "{op: external, reads: [s], writes: [y]}"]
    if draw(st.booleans()):
        sig, wait = (f"{{op: signal, {credit}, channel: c}}",
                     f"{{op: wait, {waited}, channel: c}}")
        if draw(st.booleans()):  # after the read, as a credit goes
            body += [sig, wait]
        else:
            _insert_apart(draw, st, body, sig, wait)
    text = CREDIT_HEADER.format(seed=draw(st.integers(0, 999)), slots=draw(st.integers(1, 2)))
    return text + "".join(f"  - s{i}: {s}\n" for i, s in enumerate(body))
