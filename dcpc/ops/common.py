"""What the ops share: effects, regions, signal channels and the helpers their rules use.

An op's semantics rule (in its module under dcpc/ops/) returns ``Semantics(effects,
sync)``. Effects happen ``before`` the step's signal (its push; the whole step for an
op that does not synchronise) or ``after`` its wait. A remote store carries a
``Region``: it writes the writing rank's part of EVERY rank's instance, its own
included; a remote read (pull) carries ``Region("whole")``: it reads every rank's.

Signals (docs/internals.md): a signalling step owns the signal slots of channel
``index * slots + slot`` and advances its own epoch there once per call; a
communication op waits on its own slots; a ``wait`` step polls the slots of ONE
``signal`` step, chosen here: on a channel, the k-th wait ``from: F`` polls the k-th
signal whose ``to`` reaches it (``from: prev`` <- ``to: next | all``, ``from: next``
<- ``to: prev | all``, ``from: all`` <- ``to: all``). The choice does not depend on
W, so one emitted module serves every group size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from dcpc.diagnostics import Mark
from dcpc.lang import expr as ex
from dcpc.lang import nodes as m
from dcpc.lang.mesh import Torus, mesh_of, shape_of, torus
from dcpc.ops.iface import Requests, TensorScale
from dcpc.topology import along, perm_sources

if TYPE_CHECKING:
    from dcpc.lang.nodes import ScheduleView
    from dcpc.ops.iface import InputRule, Ref, ShapeRules

READ, WRITE = "read", "write"
BEFORE, AFTER = "before", "after"


@dataclass(frozen=True)
class Region:
    """The part of every rank's instance that one writer's store covers.

    Writer ``p`` covers part ``p`` of a partition of axis ``dim``: a contiguous
    ``block`` (concatenating all_gather), an ``index`` of a W-long axis (stacking
    all_gather, all_to_all, receive buffers) or every ``interleave``-th row block.
    Stores of the same partition overlap only when their writers are equal; stores
    of different partitions may always overlap.

    Scheme ``peer`` (shift): writer ``p`` stores into the WHOLE instance of rank
    ``p + offset`` (mod W) only, no other rank's (with ``axes``: of member ``p + offset``
    of its team, mod the team size); two peer stores of one offset meet
    on an instance only when their writers are equal, so they form a partition too.
    Scheme ``line`` (a shift with ``wrap: false``): the same store, made only when
    ``0 <= p + offset < W`` (the team size, member indices); the ranks ``r`` with
    ``r - offset`` outside get none (``covers_all`` False: the data flow does not
    count it as written there). The happens-before checkers take it as ``peer`` on
    every rank (more stores: sound).
    Scheme ``perm`` (a shift's ``perm:``): writer ``p`` stores into the whole instance of
    rank ``table[p]`` only (none where it is -1); two stores of one table meet on an
    instance only when their writers are equal (a perm is one-to-one). ``covers_all``
    only when every rank is a destination. The happens-before checkers, whose model is
    rotation-symmetric, take every rank's store at every delta ``table[p] - p`` of the
    table (``writers``: phantom stores only add races); the brute force and the
    execution oracle use the table itself.
    ``peer`` set (a ragged_all_to_all by ``offset:``, one peer per rank): writer ``p``'s
    part ``p`` of its scheme (``index`` / ``block``) goes into the instance of rank
    ``p + peer`` (mod W; with ``axes``, of that team member) only, no other rank's. Its
    partition is the scheme's, ``peer`` left out: such stores, whatever their peer, and
    the scheme's stores into every rank meet only when their writers are equal (on an
    instance, the writers the two reach it from: ``writers``).
    Scheme ``whole`` (a remote READ, pull's): reader ``p`` reads the WHOLE of every rank's
    instance; reads only (``effects`` refuses a write of it), so two accesses of the
    partition are never compared, and every other access overlaps it.
    """

    scheme: str  # "block" | "index" | "interleave" | "peer" | "line" | "root" | "whole"
    dim: int
    interleave: int = 0
    dim_text: str = ""
    offset: int = 0  # scheme "peer": the target is rank writer + offset
    # the writer's team (dcpc.lang.mesh): its store reaches the instances of its team
    # members only, and ``writer`` is its index in that team. None: every axis.
    axes: tuple[int, ...] | None = None
    table: tuple[int, ...] = ()  # scheme "perm": the destination of each rank, -1: none
    peer: int | None = None  # index/block: the store reaches rank writer + peer only

    @property
    def owners_all(self) -> bool:
        """Whether one writer's store reaches every rank's instance (not ``peer``)."""
        return self.scheme not in ("peer", "line", "perm") and self.peer is None

    @property
    def covers_all(self) -> bool:
        """Whether every rank's instance gets this store from some writer (not ``line``:
        the first ``offset`` ranks of the line get none; ``perm``: when every rank is a
        destination)."""
        if self.scheme == "perm":
            return sorted(self.table) == list(range(len(self.table)))
        return self.scheme != "line"

    def target(self, rank: int, topo: Torus) -> int | None:
        """The rank whose instance ``rank``'s store of a ``line`` or ``perm`` region
        reaches in the program: a line's member + ``offset`` of ``rank``'s team along
        ``axes`` (dcpc.topology ``Torus.peer``), none past either end; a perm's
        ``table[rank]`` (a table of ``topo``'s size), none for -1. None: ``rank`` stores
        nothing, so it makes no push and reads none of the shift's ``src``: the one rule
        of where such a store lands, which the data flow (dcpc.check.flow) and the
        happens-before checkers (dcpc.check.hb.races ``made``) both ask."""
        if self.scheme == "line":
            return topo.peer(rank, self.axes, self.offset, wrap=False)
        return self.table[rank] if self.table[rank] >= 0 else None

    def writers(self, owner: int, world: int) -> list[int]:
        """The ranks whose store of this region reaches ``owner``'s instance, peers of
        ``owner`` first (the order counterexamples prefer), then ``owner`` itself. A
        shift's (``peer``/``line``): member ``-offset`` of ``owner``'s team along
        ``axes`` (one axis, dcpc.topology ``Torus.peer``); ``line``: taken cyclically,
        as the symmetric checkers model it (a writer outside the line only adds stores)."""
        if self.scheme == "perm":  # every delta of the table, taken on every rank
            topo = torus(shape_of(world))
            found = {topo.sub(owner, perm_delta(self.table, p, topo))
                     for p in range(len(self.table)) if self.table[p] >= 0}
            # the real writer of ``owner``'s instance first (a counterexample then names
            # ranks of the real program when it can), then the other deltas' phantoms
            real = [p for p in range(len(self.table)) if self.table[p] == owner]
            return real + sorted(found - {owner} - set(real),
                                 key=lambda q: (q - owner) % world) + (
                [owner] if owner in found and owner not in real else [])
        if self.scheme in ("peer", "line") or self.peer is not None:
            k = self.offset if self.peer is None else self.peer
            writer = (along(owner, world, -k) if self.axes is None
                      else torus(shape_of(world)).peer(owner, self.axes, -k))
            return [owner if writer is None else writer]
        return [(owner + k) % world for k in range(1, world)] + [owner]

    @property
    def partition(self) -> tuple:
        base = (self.scheme, self.dim, self.interleave, self.offset)
        base = base if not self.table else (*base, self.table)
        return base if self.axes is None else (*base, self.axes)

    def text(self, writer: int, into: str | None = None) -> str:
        """The part of writer ``writer`` in words; ``into``: the rank (in words) whose
        instance a ``peer`` store reaches, None where that is the writer's own."""
        # ``writer`` of a peer, line, perm or whole (a reader): its index in its team, if any
        who = f"{'rank' if self.axes is None else 'team member'} {writer}"
        whose = f"{into}'s" if into else "its own"
        to = "" if self.peer is None else f", into {whose} only"
        if self.scheme == "block":
            return f"{self.dim_text} block {writer} (dim {self.dim}{to})".lstrip()
        if self.scheme == "index":
            return f"index {writer} of dim {self.dim}{to}"
        if self.scheme in ("peer", "line"):
            return f"whole (shift from {who}, offset {self.offset:+d})"
        if self.scheme == "perm":
            return f"whole (a perm's store from {who})"
        if self.scheme == "root":  # broadcast: every rank modelled as the root (dim: root)
            return f"the whole buffer (a store of root {self.dim}'s broadcast)"
        if self.scheme == "whole":
            return f"the whole buffer (a remote read by {who})"
        return f"rows of rank {writer}, interleave {self.interleave} (dim {self.dim})"


@dataclass(frozen=True)
class Effect:
    """One buffer access of a step: ``kind`` read|write, ``when`` before|after.

    ``region`` None: this rank's own instance, whole. ``key``: the op key that names
    the buffer ("src[0]", "mask_empty.seq_lens", ...; "" for an implicit buffer).
    ``either``: the kernel makes this access before its signal in some launches and
    after its wait in others; the table lists it in both phases, each marked (the
    checkers take both: more reads only add races), and the access tracer
    (dcpc.harness.trace) demands it in one of the two.
    ``lands``: a store the language places later than the kernel makes it: the index of
    the step whose wait lands it (a shift's: its own wait, or its ``phase: wait``). The
    store is made at the push and is IN FLIGHT until the receiver's wait of that step,
    where the data flow (what a read sees, the float64 reference) writes it
    (``data_flow``): every other access to that instance must end before the push or
    start after that wait (dcpc.check.hb.races).
    ``root``: the access happens on team member ``root`` only: a store into ``root``'s
    instance only, a read or write of ``root``'s own instance by ``root`` only (a
    reduce's ``via``). None: on every rank (SPMD). The data flow is exact about it (a
    read on every rank needs a write on every rank); the happens-before checkers, whose
    symmetry needs every rank to run the same accesses, take it on every rank (more
    accesses: sound, docs/hb-checker.md).
    """

    buffer: str
    kind: str
    when: str
    region: Region | None = None
    key: str = ""
    either: bool = False
    lands: int | None = None
    root: int | None = None


def data_flow(table: list[Semantics]) -> list[tuple[int, Effect]]:
    """(step index, effect) of every step's effects (``table``: by step index) in the
    order the data flow has them: step by step, each step's in the order it lists them,
    the stores in flight that land at that step's wait after its effects before the wait
    and before those after it (a split ragged_all_to_all's wait reads what landed)."""
    landing = {e.lands for sem in table for e in sem.effects if e.lands is not None}

    def order(i: int, e: Effect) -> int:
        return 1 if e.lands is not None else 2 if e.when == AFTER and i in landing else 0

    found = [((e.lands if e.lands is not None else i, order(i, e), i, k), i, e)
             for i, sem in enumerate(table) for k, e in enumerate(sem.effects)]
    return [(i, e) for _, i, e in sorted(found, key=lambda item: item[0])]


@dataclass(frozen=True)
class Sync:
    """The signal slots a step's kernel uses.

    ``signal``: the peers ("all" | "next" | "prev" | "self": the rank itself, its own
    flag, or one rank at an offset "+k" /
    "-k", |k| >= 2: a shift; "line+k" / "line-k": the rank at offset k only when it is
    one, 0 <= r + k < W, no wrap: a shift with ``wrap: false``, whose edge ranks skip
    that signal or wait) this step publishes its epoch to, in its own slots.
    ``wait``: the peers it waits for, polling the slots of step ``polls`` (its own index
    for a communication op).
    """

    signal: str | None = None
    wait: str | None = None
    polls: int | None = None
    axes: tuple[int, ...] | None = None  # the team's mesh axes (dcpc.lang.mesh); None: all


@dataclass(frozen=True)
class Semantics:
    effects: tuple[Effect, ...] = ()
    sync: Sync = field(default_factory=Sync)

    @property
    def reads(self) -> tuple[str, ...]:
        return _unique(e.buffer for e in self.effects if e.kind == READ)

    @property
    def writes(self) -> tuple[str, ...]:
        return _unique(e.buffer for e in self.effects if e.kind == WRITE)


LINE = "line"  # the prefix of a non-cyclic offset's peers: "line+k" / "line-k"
PERM = "perm:"  # the prefix of a perm's peers: "perm:3,2,1,0" (rank r's peer, -1: none)


def perm_peers(table: tuple[int, ...]) -> str:
    """The sync peers of a shift's perm: rank r signals (or waits for) ``table[r]``."""
    return PERM + ",".join(str(d) for d in table)


def perm_table(peers: str | None) -> tuple[int, ...] | None:
    """The table of a perm's peers spec, or None for any other spec."""
    if not isinstance(peers, str) or not peers.startswith(PERM):
        return None
    return tuple(int(d) for d in peers[len(PERM):].split(","))


def perm_delta(table: tuple[int, ...], rank: int, topo: Torus) -> int:
    """How far rank ``rank``'s peer in ``table`` is along the ring of ``topo`` (one axis:
    mod W); on a mesh shape, the torus translation (as a rank: the peer of rank 0) that
    takes ``rank`` to it (a perm along one axis: along that axis)."""
    return topo.sub(table[rank], rank)


def perm_deltas(table: tuple[int, ...], world: int) -> frozenset[int]:
    """Every nonzero delta of a perm table (mod W): the rotation-symmetric checker takes
    each rank's signal, wait and store at every one of them. A table is unrolled at one
    W (dcpc.lang.loops); the hints' re-checks at a larger W (dcpc.check.hb.hints) take
    its deltas mod that W, as they take a loop unrolled at one W."""
    topo = torus(shape_of(world))
    return frozenset(perm_delta(table, r, topo) for r in range(len(table))
                     if table[r] >= 0) - {0}


def offset_peers(k: int, wrap: bool = True) -> str:
    """The sync peers of one rank at offset ``k``: "next", "prev" or "+k" / "-k";
    ``wrap`` False: "line+k" / "line-k" (no peer past either end of 0 .. W-1)."""
    if not wrap:
        return f"{LINE}{k:+d}"
    return {1: "next", -1: "prev"}.get(k, f"{k:+d}")


def peer_offset(peers: str) -> tuple[int, bool]:
    """(k, wraps) of a one-rank peers spec ("next", "prev", "+k", "line+k")."""
    assert not peers.startswith(PERM), peers  # a perm has no one offset (perm_table)
    if peers in ("next", "prev"):
        return (1 if peers == "next" else -1), True
    if peers.startswith(LINE):
        return int(peers[len(LINE):]), False
    return int(peers), True


def peerless(peers: str | None) -> bool:
    """Whether a sync's peers spec meets no other rank: None (no signal or no wait) or
    ``self`` (the rank's own flag: a store into and a poll of its own slot, which only
    its own earlier signal sets). Such a step is a no-op on the torch backend (no
    message, no handshake, no team settle: the plan attr ``peerless``, sync ``_lanes``)
    and may stand between a put and its wait (shift ``_local``)."""
    return peers is None or peers == m.Peers.self.value


def wraps(peers: str | None) -> bool:
    """Whether the peers a sync names exist on every rank (not a "line" offset, whose
    edge ranks skip the signal or wait: a happens-before checker that models every rank
    alike takes no ordering from such a wait, only its dependency; nor a perm, whose
    ranks wait on different peers, some on none)."""
    return peers is None or not peers.startswith((LINE, PERM))


def chain(peers: str | None) -> bool:
    """Whether the ranks a one-rank peers spec links form chains, no cycle: a "line"
    offset always, a perm when following it never comes back to a rank (a fixed point
    is a cycle of one). A wait before its put on such peers is live whatever W (edge
    ranks start it: dcpc.check.hb.clocks); on a cycle, every rank would wait first."""
    if isinstance(peers, str) and peers.startswith(LINE):
        return True
    table = perm_table(peers)
    if table is None:
        return False
    for start in range(len(table)):
        seen, r = set(), start
        while r >= 0:
            if r in seen:
                return False
            seen.add(r)
            r = table[r]
    return True


def ring_hops(peers: str | None) -> int:
    """How many ranks a wait from ``peers`` moves a happens-before chain along the ring
    (0 for none, "all", which reaches every rank at once, or "self", the rank itself):
    the world bound counts it."""
    if peers in (None, "all", "self") or perm_table(peers) is not None:  # a perm's joins no clock
        return 0
    return abs(peer_offset(peers)[0])  # type: ignore[arg-type]


def _unique(names: object) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))  # type: ignore[call-overload]


# --- the signal channels --------------------------------------------------------

# The ``to`` values whose signal reaches a wait ``from: F`` at every W (``from: self``:
# only ``to: self``, the rank's own flag; a signal to peers never reaches the rank itself).
REACHES = {m.Peers.prev: (m.Peers.next, m.Peers.all), m.Peers.next: (m.Peers.prev, m.Peers.all),
           m.Peers.all: (m.Peers.all,), m.Peers.self: (m.Peers.self,)}


def reaches(sent: str, polled: str, size: int | None = None) -> bool:
    """Whether a signal to the peers spec ``sent`` reaches a wait from ``polled`` at every
    W (``Sync``'s specs): a signal to all reaches every wait; a wait from all only it;
    any other wait the signal of its inverse (from prev <- to next: "prev" <- "next";
    an offset's "-k" <- "+k"; a perm's sources <- its destinations). ``size``: the team
    size of a schedule unrolled at one W (``unrolled_size``), where offsets are alike
    mod it (a perm's "+3" <- an offset's "-1" at W = 4; None: at every W). The rank's
    own flag ("self") reaches a wait from "self" only."""
    if m.Peers.self.value in (sent, polled):
        return sent == polled
    if sent == m.Peers.all.value or polled == m.Peers.all.value:
        return sent == m.Peers.all.value
    return _mod(sent, size) == _mod(inverse_peers(polled), size)


def unrolled_size(schedule: Any, op: Any) -> int | None:
    """The size of ``op``'s team where ``schedule`` was unrolled at one W or mesh shape
    (``loop_world``: a perm, or W named), else None (checked at every W)."""
    served = getattr(schedule, "loop_world", None)
    if served is None:
        return None
    mesh = mesh_of(schedule)
    if isinstance(served, tuple):
        return torus(served).team_size(mesh.team_axes(op))
    return int(served) if len(mesh.axes) < 2 else None


def _mod(spec: str, size: int | None) -> str:
    """One peer per rank by an offset taken mod ``size`` (None, or any other spec: as
    is), the one form two offsets alike at that size share."""
    if size is None or spec in (m.Peers.all.value, m.Peers.self.value) \
            or perm_table(spec) is not None:
        return spec
    k, wrap = peer_offset(spec)
    return offset_peers(k % size) if wrap and k % size else spec


def inverse_peers(spec: str) -> str:
    """The peers spec of the other end of one peer per rank: of a wait from ``spec``, the
    signal that reaches it, and back (next <-> prev, "+k" <-> "-k", a perm's
    destinations <-> its sources, dcpc.topology ``perm_sources``); "self" is its own."""
    if spec == m.Peers.self.value:
        return spec
    found = perm_table(spec)
    if found is not None:
        return perm_peers(perm_sources(found))
    return offset_peers(-peer_offset(spec)[0])


def peers_of(spec: m.Peers | str | None, rank: int, world: int,
             axes: tuple[int, ...] | None = None) -> list[int]:
    """The ranks a sync's peers spec names on ``rank`` (a signal's targets, a wait's
    sources), in its team along ``axes`` (a mesh's; None: every rank), in the kernel's
    loop order (templates/sync.j2 prologue: lane k is member RANK + 1 + k of the team,
    mod its size): ``all`` every other member from the next one on; next, prev, "+k",
    "line+k" (no peer past either end) member RANK + k (dcpc.topology ``Torus.peer``); a
    perm's "perm:<table>" rank r's own entry (a wait's: its table of sources), none for
    -1 or the rank itself; ``self`` the rank itself (its own flag, the kernel's self
    lane); None (no sync) nobody. The one mapping for every stage that names the ranks
    of one sync: the happens-before checker's real-steps cut (dcpc.check.hb.legal) and
    its deadlocks the model does not name (dcpc.check.hb.checker ``_unmodelled``), the
    execution oracle (dcpc.check.oracle) and the ``when:`` checks' edges
    (dcpc.check.when)."""
    spec = spec.value if isinstance(spec, m.Peers) else spec
    if spec is None:
        return []
    if spec == m.Peers.self.value:
        return [rank]
    topo = torus(shape_of(world))
    if spec == m.Peers.all.value:
        team = topo.team(rank, axes)
        me = topo.member(rank, axes)
        return [team[(me + k) % len(team)] for k in range(1, len(team))]
    table = perm_table(spec)
    if table is not None:
        p = table[rank] if rank < len(table) else -1
        return [p] if 0 <= p < topo.size and p != rank else []
    p = topo.peer(rank, axes, *peer_offset(spec))
    return [p] if p is not None and p != rank else []


def said(op: Any) -> str:
    """A signal's or wait's peers as written: all, next, prev, offset k or perm P (as
    written, kept by the unroller, not its table at one W)."""
    if getattr(op, "perm", None) is not None:
        written = getattr(op, "written", None)
        return f"perm {op.perm if written is None else written}"
    if getattr(op, "offset", None) is not None:
        return f"offset {op.offset}"
    return (op.to if op.op == "signal" else op.from_).value


@dataclass(frozen=True)
class ChannelError:
    step: m.Step
    code: str  # "unmatched-wait" | "peer-mismatch" | "unpolled-signal" | "unmatched-signal" (w)
    message: str
    hint: str | None
    key: str  # the op key to point at


@dataclass
class Channels:
    """Which signal step each wait step polls (by step name), and what cannot match."""

    polls: dict[str, m.Step] = field(default_factory=dict)
    errors: list[ChannelError] = field(default_factory=list)


def channels(schedule: ScheduleView) -> Channels:
    """Match every ``wait`` step with the ``signal`` step whose slots it polls."""
    out = Channels()
    steps = schedule.step_list()
    signals: dict[str, list[m.Step]] = {}
    for step in steps:
        if step.kind == "signal":
            signals.setdefault(step.op.channel, []).append(step)
    # the k-th wait from F over a team polls the k-th signal that reaches it: counted per
    # (channel, from, team), so two teams may share a channel name (issue 31, m14)
    seen: dict[tuple[str, m.Peers, Any], int] = {}
    polled: set[str] = set()
    mesh = mesh_of(schedule)
    # the signals a wait may poll depend on its channel, its 'from' and its team only
    reaching: dict[tuple[str, m.Peers, Any], list[m.Step]] = {}
    for step in steps:
        op = step.op
        if step.kind != "wait":
            continue
        if op.offset == 0:  # it polls nothing: its bad-offset (sync.verify) says the fix,
            continue  # 'from: self'; no second error
        sent = signals.get(op.channel, [])
        if not sent:
            out.errors.append(ChannelError(
                step, "unmatched-wait",
                f"step '{step.name}' waits on channel '{op.channel}', but no step signals "
                "it; the wait can never finish", None, "channel"))
            continue
        size = unrolled_size(schedule, op)
        spec = _mod(op.peers(schedule), size)  # type: ignore[attr-defined]
        team = (op.channel, spec, mesh.team_axes(op))
        k = seen.get(team, 0)
        seen[team] = k + 1
        if team not in reaching:
            reaching[team] = [s for s in sent if reaches(s.op.peers(schedule), spec, size)  # type: ignore[attr-defined]
                              and team_reaches(schedule, s, step)]
        fits = reaching[team]
        if k < len(fits):
            out.polls[step.name] = fits[k]
            polled.add(fits[k].name)
            continue
        key = next((k for k in ("from", "offset", "perm") if k in op.src_marks), "")
        wanted = (" or ".join(f"'to: {p.value}'" for p in REACHES[op.from_])
                  if said(op) == op.from_.value else f"'to: all' or '{said(op)}'")
        if not fits:
            # a signal whose peers reach this wait's but over another team: name the axis
            apart = next((s for s in sent if reaches(s.op.peers(schedule), spec, size)), None)  # type: ignore[attr-defined]
            other = sent[0] if apart is None else apart
            out.errors.append(ChannelError(
                step, "peer-mismatch",
                f"step '{step.name}' waits for '{said(op)}' peers on channel "
                f"'{op.channel}', but no signal on it goes to them (step '{other.name}' "
                f"signals '{said(other.op)}' peers"
                + (")" if apart is None else f" {_axes_said(other.op)}; this wait's are "
                   f"{_axes_said(op)})"),
                f"use {wanted} on '{other.name}', or another '{key or 'from'}' here"
                if apart is None else _axis_hint(op, other), key))
        else:
            out.errors.append(ChannelError(
                step, "unmatched-wait",
                f"step '{step.name}' is wait number {k + 1} from '{said(op)}' on "
                f"channel '{op.channel}', but only {len(fits)} signal step(s) on it reach "
                f"'{said(op)}' waits; each wait polls its own signal step",
                f"add a signal with {wanted} on channel '{op.channel}' before it, or use "
                "another channel", key))
    for name, sent in signals.items():
        waits = [s for s in steps if s.kind == "wait" and s.op.channel == name]  # type: ignore[attr-defined]
        for step in sent:
            if step.name in polled:
                continue
            if not waits:
                out.errors.append(ChannelError(
                    step, "unmatched-signal",
                    f"step '{step.name}' signals channel '{name}', but no step waits on it",
                    "add a wait or drop the signal", "channel"))
                continue
            if any(w.name not in out.polls for w in waits):
                continue  # that wait's own error says what is wrong on the channel
            # the channel's waits poll other signals: almost surely a pairing mistake
            pairs = ", ".join(f"'{w.name}' polls '{out.polls[w.name].name}'" for w in waits)
            out.errors.append(ChannelError(
                step, "unpolled-signal",
                f"step '{step.name}' signals channel '{name}', but no wait polls it "
                f"({pairs})",
                f"each wait 'from: F' polls the next signal whose 'to' reaches F (from: prev "
                f"<- to: next | all, from: next <- to: prev | all, from: all <- to: all); "
                f"give '{step.name}' its own wait, or its own channel", "channel"))
    return out


def _axes_said(op: Any) -> str:
    """The team an op's ``axis`` names, as words: "along 'gpu'", "over every axis"."""
    if op.axis is None:
        return "over every axis"
    axes = [op.axis] if isinstance(op.axis, str) else list(op.axis)
    return "along " + " and ".join(f"'{a}'" for a in axes)


def _axis_hint(wait: Any, signal: m.Step) -> str:
    """The fix of a wait whose signal's peers agree but whose team differs: the wait's
    axis on the signal (its team then covers the wait's)."""
    axis = ("drop 'axis'" if wait.axis is None else
            f"use 'axis: {wait.axis if isinstance(wait.axis, str) else list(wait.axis)}'")
    return f"{axis} on '{signal.name}' (the team of this wait), or another 'axis' here"


def on_team(schedule: ScheduleView, step: m.Step, sem: Semantics) -> Semantics:
    """``sem`` of a step over its op's team: its remote stores' regions and its sync
    carry the team's axes (dcpc.lang.mesh). Every axis (the default): unchanged."""
    axes = mesh_of(schedule).team_axes(step.op)
    if axes is None:
        return sem
    effects = tuple(replace(e, region=replace(e.region, axes=axes)) if e.region else e
                    for e in sem.effects)
    sync = sem.sync
    if sync.signal is not None or sync.wait is not None:
        sync = replace(sync, axes=axes)
    return Semantics(effects, sync)


def team_reaches(schedule: ScheduleView, signal: m.Step, wait: m.Step) -> bool:
    """Whether ``signal``'s team covers the peers ``wait`` polls (dcpc.lang.mesh): a
    ``to: all`` over axes A reaches waits over axes within A; ``next``/``prev`` the
    waits along the same axis. Always true without a mesh."""
    mesh = mesh_of(schedule)
    every = tuple(range(len(mesh.axes)))
    sent = mesh.team_axes(signal.op) or every
    polled = mesh.team_axes(wait.op) or every
    if signal.op.peers(schedule) == m.Peers.all.value:  # type: ignore[attr-defined]
        return set(polled) <= set(sent)
    return polled == sent


# --- what the ops' rules share ---------------------------------------------------

class Scope:
    """What a rule may look at beyond its step: the schedule, its steps and its
    channels (matched once)."""

    def __init__(self, schedule: ScheduleView):
        self.schedule = schedule
        self.steps = schedule.step_list()
        self._channels: Channels | None = None

    @property
    def channels(self) -> Channels:
        if self._channels is None:
            self._channels = channels(self.schedule)
        return self._channels


Rule = Callable[[Scope, m.Step], Semantics]
OpT = TypeVar("OpT", bound=m.OpBase)


def typed(step: m.Step, cls: type[OpT]) -> OpT:
    """The step's op as the model class of the op whose rule was handed the step."""
    assert isinstance(step.op, cls), (step.name, type(step.op).__name__)
    return step.op


def keyed(op: m.OpBase, key: str) -> list[tuple[str, str]]:
    """(buffer, key) for the buffers an op names under ``key`` (a name or a list)."""
    value = getattr(op, key, None)
    if isinstance(value, str):
        return [(value, key)]
    if isinstance(value, list):
        return [(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return []


def mask_inputs(op: m.OpBase) -> list[tuple[str, str]]:
    """(buffer, key) of mask_empty's lengths and query_start_loc (none without it)."""
    mask = getattr(op, "mask_empty", None)
    if mask is None:
        return []
    return [(mask.lengths, f"mask_empty.{mask.lengths_key}"),
            (mask.query_start_loc, "mask_empty.query_start_loc")]


# The key of an op that computes its dst (a reduction, a merge, a weighted sum): the [1]
# f32 scale of an fp8 dst, dst = clamp(out / scale[0], -448, 448) rounded to e4m3. Every
# op whose model declares it falls under one rule (dcpc.check.ops ``_output_scale``):
# an fp8 dst needs it. The kernels refuse a scale that is not a positive finite normal.
OUTPUT_SCALE = "output_scale"


def merge_inputs(op: m.OpBase) -> list[tuple[str, str]]:
    """(buffer, key) a merge reads besides its partials: mask_empty's lengths and
    query_start_loc, and output_scale."""
    return mask_inputs(op) + keyed(op, OUTPUT_SCALE)


def merge_input_rules(op: m.OpBase) -> dict[str, InputRule]:
    """The synthetic-input rules (``OpDef.inputs``) of an op that computes its dst: its
    ``output_scale`` is a per-tensor fp8 scale; ``mask_empty``'s buffers are the
    request mask over the rows of ``dst``."""
    mask = getattr(op, "mask_empty", None)
    rules: dict[str, InputRule] = {}
    if mask is not None:
        rules.update({name: Requests(mask, op.dst) for name, _ in mask_inputs(op)})  # type: ignore[attr-defined]
    rules.update({name: TensorScale((op.dst,)) for name, _ in keyed(op, OUTPUT_SCALE)})  # type: ignore[attr-defined]
    return rules


def effects(kind: str, when: str, pairs: list[tuple[str, str]],
            region: Region | None = None, *, either: bool = False,
            lands: int | None = None, root: int | None = None) -> list[Effect]:
    # an op's rule error, not input's: the race search compares one writer only within a
    # partition, which a write of every rank's whole instance would break
    if region is not None and region.scheme == "whole" and kind != READ:
        raise ValueError("a region 'whole' is a remote read; it is never written")
    return [Effect(b, kind, when, region, key, either, lands, root) for b, key in pairs]


def exchange(before: list[Effect], after: list[Effect], step: m.Step) -> Semantics:
    """A communication op: push, signal every peer, wait for every peer, then ``after``."""
    return Semantics(tuple(before + after), Sync("all", "all", step.index))


def dim_text(schedule: ScheduleView, buffer: str, dim: int) -> str:
    spec = schedule.buffers.get(buffer)
    if spec is None or not 0 <= dim < len(spec.shape):
        return f"dim {dim}"
    value = spec.shape[dim]
    if isinstance(value, int):
        return str(value)
    try:
        return ex.unparse(ex.parse(value))
    except Exception:  # noqa: BLE001 (a bad shape is the structural checker's report)
        return str(value)


def local(reads: list[tuple[str, str]], writes: list[tuple[str, str]]) -> Semantics:
    """An op on this rank only: it reads, then writes, and synchronises nothing."""
    return Semantics(tuple(effects(READ, BEFORE, reads) + effects(WRITE, BEFORE, writes)))


def effect_mark(step: m.Step, effect: Effect) -> Mark:
    """Where the schedule names the buffer of ``effect`` (the step for an implicit one)."""
    if effect.key == "scale.buffer":
        return step.op.scale.mark("buffer")  # type: ignore[attr-defined]
    if effect.key.startswith("mask_empty."):
        return step.op.mask_empty.mark(effect.key.split(".", 1)[1])  # type: ignore[attr-defined]
    return step.op.mark(effect.key) if effect.key else step.mark()


def buffers_of(pairs: list[tuple[str, str]]) -> list[str]:
    """The buffer names of (buffer, key) pairs."""
    return [b for b, _ in pairs]


def integer_index(v: ShapeRules, step: m.Step, ref: Ref, holds: str) -> m.Buffer | None:
    """An index an op reads (weighted_combine's rows, ragged_all_to_all's placement): i32
    or i64, else ``bad-index`` saying what its integers are (``holds``). Its buffer, or
    None (undeclared: reported)."""
    buf = v.buffer(ref.name)
    if buf is not None and buf.dtype.value not in ("i32", "i64"):
        v.error(ref.mark, "bad-index",
                f"index '{ref.name}' of step '{step.name}' is {buf.dtype.value}; it holds "
                f"{holds} (i32 or i64)", hint=f"declare '{ref.name}' with dtype i32")
    return buf
