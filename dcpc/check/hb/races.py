"""Races on symmetric buffer instances, from rank 0's vector clocks.

By rotation symmetry it is enough to look at the instances rank 0 owns: a race on
rank r's instance is the same race rotated by r. The accesses to rank 0's
instance of a buffer (per slot, or one for all slots when ``shared``) come in
groups, one per (call, event, access):

- a *local* group: rank 0 reads or writes its whole instance (one access);
- a *store* group: every rank p stores its part p (W accesses), or, for a ``peer``
  store (shift), the one rank ``-offset`` stores the whole instance.

Two groups are compared with O(1) clock look-ups (local/local, or stores of the
same partition, which only overlap for the same writer), O(W) (local/stores) or
O(W^2) (stores of different partitions), never by enumerating event pairs.

A store in flight (``Access.lands``: a split-phase shift's) is an interval: it starts
at the writer's push and ends at the owner's wait of the step that lands it, where the
data flow writes it. Two overlapping accesses, one a write, conflict unless one ENDS
before the other STARTS in happens-before (for an ordinary access start and end are the
access itself): an access between a put and its wait, on any rank, is a race even when
a barrier orders it after the push, and two stores in flight into one instance must
not overlap. Ordered that way, two accesses are also ordered as the data flow orders
them (``intended``, which classifies): happens-before never runs against the order of
calls and steps (a wait that polls a later step of its call never returns).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from dcpc.check.hb.clocks import World
from dcpc.check.hb.events import PHASE_ORDER, Access, Event
from dcpc.lang.mesh import Torus, shape_of, torus
from dcpc.lang.semantics import Region

WAR, RAW, WAW = "write-after-read", "read-after-write", "write-after-write"


@dataclass(frozen=True)
class Touch:
    """One concrete access: ``rank`` runs event j of ``call``, touching ``owner``'s instance."""

    rank: int
    call: int
    j: int
    access: Access
    owner: int

    def order_key(self, world: World) -> tuple[int, int, int]:
        """The order the schedule intends: call, step, then phase within the step."""
        return intended(world, self.call, self.j, self.access)


def end_need(world: World, call: int, j: int, access: Access) -> int:
    """1 + the stream index of the event that ends an access of event j of ``call``: the
    event itself, or for a store in flight its owner's wait of the landing step."""
    if access.lands is not None:
        j = world.program.recv_of[access.lands]
    return world.program.stream_index(call, j) + 1


def end_stream(world: World, call: int, j: int, access: Access) -> int:
    """The stream of the event that ends an access of event j of ``call`` (its slot's;
    with roles, the role of that event: a store in flight ends in its owner's wait)."""
    if access.lands is not None:
        j = world.program.recv_of[access.lands]
    return world.program.stream_of(call, j)


def put_need(world: World, call: int, j: int, access: Access) -> tuple[int, int] | None:
    """With roles (docs/proposals/roles.md prototype): (stream, stream index + 1) of the put of a
    store in flight, which must ALSO come before what follows it: in one program order,
    and between ranks through the landing's signal, the landing wait comes after the put,
    but a rank's own part lands at a wait of another role that nothing orders after the
    put (an offset-0 put, a local copy, signals nobody). None: no such condition."""
    if access.lands is None or not world.program.roles:
        return None
    return world.program.stream_of(call, j), world.program.stream_index(call, j) + 1


def intended(world: World, call: int, j: int, access: Access) -> tuple[int, int, int]:
    """Where the data flow places ``access`` of event j of ``call``: (call, step, phase
    within the step); a store in flight at the wait of the step that lands it."""
    if access.lands is not None:
        return (call, access.lands, PHASE_ORDER["recv"])
    event = world.program.events[j]
    return (call, event.step, PHASE_ORDER[event.phase])


@dataclass(frozen=True)
class RawRace:
    """Two conflicting accesses, ``first`` before ``second`` in intended order: neither
    ends before the other starts (a store in flight ends where it lands)."""

    cls: str
    buffer: str
    first: Touch
    second: Touch
    slot: int | None  # the instance's slot; None for a shared buffer

    @property
    def in_flight(self) -> bool:
        return self.first.access.lands is not None or self.second.access.lands is not None

    def key(self, world: World) -> tuple[str, str, str, str, str]:
        steps = world.program.steps
        a = steps[world.program.events[self.first.j].step].name
        b = steps[world.program.events[self.second.j].step].name
        return ("race", self.cls, self.buffer, a, b)


def _instances(world: World, buffer: str) -> list[tuple[int | None, list[int]]]:
    """(slot or None, calls that touch the instance) for rank 0's instances of a buffer.

    A per-slot instance is checked for slot 0 only: slot s's calls s and s + slots
    relate exactly like calls 0 and slots (happens-before is invariant under shifting
    every call by one on a single stream, and per-slot streams are copies that never
    order each other), so every slot has the races of slot 0."""
    program, calls = world.program, range(world.calls)
    if program.shared[buffer]:
        return [(None, list(calls))]
    return [(0, [c for c in calls if c % program.slots == 0])]


def _groups(world: World, touching: list[tuple[int, Access]],
            calls: list[int]) -> list[tuple[int, int, Access]]:
    """The live (call, event, access) groups of one instance; the same access twice in
    one event is one group."""
    out = []
    for call in calls:
        base = call * world.n
        out.extend((call, j, a) for j, a in touching if world.live[base + j])
    return out


def _touching(world: World) -> dict[str, list[tuple[int, Access]]]:
    """Per tracked buffer, its (event, access) pairs, without repeats within an event."""
    out: dict[str, list[tuple[int, Access]]] = {}
    for j, event in enumerate(world.program.events):
        for a in dict.fromkeys(event.accesses):
            out.setdefault(a.buffer, []).append((j, a))
    return out


def _peer_first(world: int) -> list[int]:
    """Ranks in the order counterexamples prefer them: peers first, then rank 0."""
    return list(range(1, world)) + [0]


def _writers(world: World, access: Access) -> list[int]:
    """The ranks whose store of ``access`` reaches rank 0's instance: rank 0's team
    along the store's axes (every rank without a mesh), peers first, then rank 0."""
    region = access.region
    if region is not None and not region.owners_all:  # a shift: its one writer (along
        return region.writers(0, world.world)  # one axis: the structural check)
    axes = region.axes if region is not None else None
    if axes is None:
        return _peer_first(world.world)
    team = torus(shape_of(world.world)).team(0, axes)
    return [r for r in team if r != 0] + [0]


def _rank_pairs(world: World, a: tuple[int, int, Access], b: tuple[int, int, Access],
                every: bool = False) -> list[tuple[int, int]]:
    """The (rank of a, rank of b) whose accesses of groups a and b to rank 0's instance
    overlap, and that some translation of the torus makes both (``made``: the model gives
    every rank a perm's store at every delta, a broadcast's from every rank, a line's
    past its end and a shift's src read where the rank sends nothing; a pair of those
    no translation makes names accesses no rank does), in the order counterexamples
    prefer: the one definition of which concrete accesses conflict (their groups write,
    one at least: the caller). ``every``: each common writer of two stores of one
    partition, which the symmetric model needs only one of (by translation) but the
    ranks' real steps (legal.Execution) each."""
    (_, ja, xa), (_, jb, xb) = a, b

    def together(p: int, q: int) -> bool:
        return (_translations(world, ja, xa, p) & _translations(world, jb, xb, q)
                & _meets(world, xa, p, xb, q)) != 0

    if not xa.remote and not xb.remote:
        return [(0, 0)] if together(0, 0) else []
    if xa.remote and xb.remote:
        assert xa.region is not None and xb.region is not None
        if xa.region.partition == xb.region.partition:
            # writer p's parts overlap only with writer p's: by translation, any p of
            # rank 0's team is the same (whether p's events are ordered does not
            # depend on whose instance they store into)
            # (a perm's store has a writer at each of its deltas, and one in flight ends
            # on the owner, rank 0, whose distance to the writer matters: each is tried)
            # (a store into one peer's instance, Region.peer, reaches rank 0 from one
            # writer: the two meet there only at a writer both have)
            theirs = set(_writers(world, xb))
            ps = [p for p in _writers(world, xa) if p in theirs and together(p, p)]
            ps = ps if every or xa.region.scheme == "perm" else ps[:1]
            return [(p, p) for p in ps]
        return [(p, q) for p in _writers(world, xa) for q in _writers(world, xb)
                if together(p, q)]
    # one local access of rank 0, one store group: rank 0's whole instance meets part p
    pairs = [(0, p) if not xa.remote else (p, 0)
             for p in _writers(world, xb if xb.remote else xa)]
    return [(p, q) for p, q in pairs if together(p, q)]


def _translations(world: World, j: int, access: Access, rank: int) -> int:
    """The translations d of the torus at which ``rank``'s ``access`` of event j to rank
    0's instance, moved by d, is one the program makes (``made``) on a rank where its
    step runs (``World.execution.happens``: some rank skips a guarded step; review of
    sym26 M1: a pair of those no translation makes named a fill on a rank that runs it
    beside a push of a rank that sends nothing), as a bit mask (-1: every d, an access
    the model gives no rank it lacks and no guard skips); cached per W (O(W) each)."""
    key = (j, id(access), rank)
    mask = world.made_at.get(key)
    if mask is None:
        topo, t = torus(shape_of(world.world)), Touch(rank, 0, j, access, 0)
        ex = world.execution
        mask = -1 if ex is None and not modelled(world, t) else sum(
            1 << d for d in range(topo.size) if made(world, rotated(t, d, topo))
            and (ex is None or ex.happens(t, topo.add(rank, d))))
        world.made_at[key] = mask
    return mask


def _meets(world: World, xa: Access, p: int, xb: Access, q: int) -> int:
    """The translations d of the torus at which access xa of rank p and xb of rank q, to
    rank 0's instance, moved by d, overlap, as a bit mask (-1: at every d). They are
    apart only where one is a local access of a chunk (``Access.chunk``: index j along
    axis a of the buffer, ``b[s][j]``) and the other a store of scheme ``index`` along
    axis a whose writer's part, its member index in the owner's team, is not j: source
    m's put into block m of a slot beside the read of block j != m (chunk-precise; any
    other pair is taken whole, as always). Cached per W."""
    local, store, writer = (xa, xb, q) if xb.remote else (xb, xa, p)
    region = store.region
    if (local.chunk is None or local.remote or region is None or store.kind != "write"
            or region.scheme != "index" or region.dim != local.chunk[0]):
        return -1
    key = ("chunk", local.chunk[1], region.axes, writer)
    mask = world.made_at.get(key)
    if mask is None:
        topo = torus(shape_of(world.world))
        mask = sum(1 << d for d in range(topo.size)
                   if _member(topo, topo.add(writer, d), d, region.axes) == local.chunk[1])
        world.made_at[key] = mask
    return mask


def _member(topo: Torus, rank: int, owner: int, axes: tuple[int, ...] | None) -> int | None:
    """``rank``'s member index in ``owner``'s team along ``axes`` (None: not a member):
    the part of its store of a partition (``Region``)."""
    team = topo.team(owner, axes)
    return team.index(rank) if rank in team else None


def made(world: World, t: Touch) -> bool:
    """Whether the program makes access t, which the symmetric model gives every rank: a
    line's or perm's store where the writer's store lands on t's owner (``_lands``), a
    broadcast's from its root, a shift's push read of its ``src`` on a rank whose store
    lands anywhere (a rank past a line's end or out of a partial perm sends nothing and
    reads no src: review gc25 M2, sym26); any other access is made."""
    topo = torus(shape_of(world.world))
    region = _modelled_store(t)
    if region is None:
        region = _push_of(world.program.events, t)
        return region is None or _lands(topo, region, t.rank)
    if region.scheme in ("line", "perm"):
        return _lands(topo, region, t.rank, t.owner)
    team = topo.team(t.owner, region.axes)  # a broadcast's: its root, member ``dim``
    return team[region.dim] == t.rank


def _lands(topo: Torus, region: Region, rank: int, owner: int | None = None) -> bool:
    """Whether ``rank``'s store of a ``line`` or ``perm`` region is one the program makes,
    into ``owner``'s instance (None: into any rank's), as ``Region.target`` says (a
    perm's table of another size than W, a hint's re-check at a larger W: taken as
    made, the model's every delta)."""
    if region.scheme == "perm" and len(region.table) != topo.size:
        return True
    target = region.target(rank, topo)
    return target is not None and owner in (None, target)


def modelled(world: World, t: Touch) -> bool:
    """Whether t is an access the model gives ranks the program may not (``made``)."""
    return _modelled_store(t) is not None or _push_of(world.program.events, t) is not None


def _push_of(events: tuple[Event, ...], t: Touch) -> Region | None:
    """For a rank's read of its own instance in a send event with a ``line`` or
    ``perm`` store (a shift's push: its src read), that store's region, else None."""
    event = events[t.j]
    if t.access.kind != "read" or t.access.region is not None or event.phase != "send":
        return None
    return next((a.region for a in event.accesses if a.kind == "write"
                 and a.region is not None and a.region.scheme in ("line", "perm")), None)


def _modelled_store(t: Touch) -> Region | None:
    """The region of a store the model gives ranks the program does not (a perm's at
    every delta of its table, a broadcast's from every rank, a line's past its end),
    else None."""
    region = t.access.region
    if t.access.kind != "write" or region is None or region.scheme not in (
            "perm", "root", "line"):
        return None
    return region


def rotated(t: Touch, d: int, topo: Torus) -> Touch:
    """t translated by d: its rank and its owner."""
    return replace(t, rank=topo.add(t.rank, d), owner=topo.add(t.owner, d))


def _first_unordered(
    world: World, a: tuple[int, int, Access], b: tuple[int, int, Access]
) -> tuple[Touch, Touch] | None:
    """A pair of concrete accesses of groups a and b, to rank 0's instance, that race:
    neither ends before the other starts. The caller has ruled out a pair ordered so on
    every rank (find_races: the minimum over the ranks of one event's clock entries for
    the other's stream)."""
    (ca, ja, xa), (cb, jb, xb) = a, b
    pa, pb = world.pos(ca, ja), world.pos(cb, jb)
    same_event = pa == pb
    # World.hb(end of a, start of b) and back, with the streams and stream positions of
    # the ends read once; a store in flight ends on the owner, rank 0
    count = world.count
    stream_a, need_a = end_stream(world, ca, ja, xa), end_need(world, ca, ja, xa)
    stream_b, need_b = end_stream(world, cb, jb, xb), end_need(world, cb, jb, xb)
    fa, fb = xa.lands is not None, xb.lands is not None
    put_a, put_b = put_need(world, ca, ja, xa), put_need(world, cb, jb, xb)
    for ra, rb in _rank_pairs(world, a, b):
        if same_event and ra == rb:
            continue
        if (count(pb, 0 if fa else ra, rb, stream_a) < need_a
                and count(pa, 0 if fb else rb, ra, stream_b) < need_b):
            return Touch(ra, ca, ja, xa, 0), Touch(rb, cb, jb, xb, 0)
        if put_a is None and put_b is None:
            continue
        # (roles) a store in flight has ended only once its put has happened too
        a_ended = count(pb, 0 if fa else ra, rb, stream_a) >= need_a and (
            put_a is None or count(pb, ra, rb, put_a[0]) >= put_a[1])
        b_ended = count(pa, 0 if fb else rb, ra, stream_b) >= need_b and (
            put_b is None or count(pa, rb, ra, put_b[0]) >= put_b[1])
        if not (a_ended or b_ended):
            return Touch(ra, ca, ja, xa, 0), Touch(rb, cb, jb, xb, 0)
    return None


def classify(world: World, x: Touch, y: Touch) -> tuple[str, Touch, Touch]:
    """Race class and the two accesses in intended order (first, second)."""
    first, second = sorted((x, y), key=lambda t: (t.order_key(world), t.rank))
    if first.access.kind == "write" and second.access.kind == "write":
        return WAW, first, second
    write = first if first.access.kind == "write" else second
    read = second if write is first else first
    if write.order_key(world) > read.order_key(world):
        return WAR, first, second
    return RAW, first, second


def _pair_key(world: World, buffer: str, a: tuple[int, int, Access],
              b: tuple[int, int, Access]) -> tuple[str, str, str, str, str]:
    """The key ``classify`` gives any race between groups a and b: it depends on the
    groups only (ranks break ties of one event, whose two sides name the same step)."""
    events, steps = world.program.events, world.program.steps
    ka = (a[0], a[2].lands, 1) if a[2].lands is not None else \
        (a[0], events[a[1]].step, PHASE_ORDER[events[a[1]].phase])
    kb = (b[0], b[2].lands, 1) if b[2].lands is not None else \
        (b[0], events[b[1]].step, PHASE_ORDER[events[b[1]].phase])
    (kf, first), (ks, second) = sorted(((ka, a), (kb, b)), key=lambda item: item[0])
    if first[2].kind == "write" and second[2].kind == "write":
        cls = WAW
    else:
        write, read = (kf, ks) if first[2].kind == "write" else (ks, kf)
        cls = WAR if write > read else RAW
    # named by the steps that make the accesses (a store in flight: its put)
    return ("race", cls, buffer, steps[events[first[1]].step].name,
            steps[events[second[1]].step].name)


PairKeys = dict[tuple[str, int | None], dict[tuple[int, int, bool], tuple[str, ...]]]


def find_races(world: World, pair_keys: PairKeys | None = None) -> list[RawRace]:
    """One race per (class, buffer, step pair), the first found, for this W.

    Pairs are visited in the same order as always (groups by call, then event), so
    the race kept per key is the same; a pair whose key already has its race, or
    that is ordered on every rank, is skipped before any per-rank clock is read. The
    key of a pair depends on its two (event, access) and on whether the calls are
    equal (groups come call by call), so it is looked up in a table, not recomputed.
    That table depends on the program only, not on W: ``pair_keys`` (one dict for
    every W of one program) keeps it from one W to the next."""
    found: dict[tuple[str, str, str, str, str], RawRace] = {}
    pair_keys = {} if pair_keys is None else pair_keys
    touching = _touching(world)
    program = world.program
    lows, low = world.lows, world.low  # the cache low() fills, read first (hot loop)
    for buffer in sorted(program.shared):
        signatures = touching.get(buffer, [])
        sig_of = {(j, id(access)): n for n, (j, access) in enumerate(signatures)}
        for slot, calls in _instances(world, buffer):
            groups = _groups(world, signatures, calls)
            # per group: position, stream, stream index + 1 of where it ends (a store in
            # flight: where it lands), writes?, signature, call
            meta = [(world.pos(call, j), end_stream(world, call, j, access),
                     end_need(world, call, j, access),
                     access.kind == "write", sig_of[(j, id(access))], call,
                     put_need(world, call, j, access))
                    for call, j, access in groups]
            keys = pair_keys.setdefault((buffer, slot), {})
            writes = [a.kind == "write" for _, a in signatures]
            # the groups of each call end here (groups come call by call)
            ends: dict[int, int] = {}
            for k, item in enumerate(meta):
                ends[item[5]] = k + 1
            for i, a in enumerate(groups):
                pa, sa, na, wa, ga, ca, ua = meta[i]
                stop = len(groups)
                if found:  # (with none found, a later call's pair that can race is left)
                    later = [keys.get((ga, gb, False)) for gb in range(len(signatures))
                             if wa or writes[gb]]
                    if None not in later and all(key in found for key in later):
                        stop = ends[ca]  # every later call's pair has its race: this call only
                for k in range(i + 1, stop):
                    pb, sb, nb, wb, gb, cb, ub = meta[k]
                    if not (wa or wb):
                        continue
                    b = groups[k]
                    key = keys.get((ga, gb, ca == cb))
                    if key is None:
                        key = keys[(ga, gb, ca == cb)] = _pair_key(world, buffer, a, b)
                    if key in found:
                        continue
                    # one ends before the other starts on every rank: no race. The
                    # entries of pb's clock for pa's stream on all ranks are what the O(W)
                    # (or O(W^2)) rank loops would look at; their minimum decides it
                    low_b = lows.get((pb, sa))
                    if low_b is None:
                        low_b = low(pb, sa)
                    if low_b >= na and (ua is None or low(pb, ua[0]) >= ua[1]):
                        continue
                    low_a = lows.get((pa, sb))
                    if low_a is None:
                        low_a = low(pa, sb)
                    if low_a >= nb and (ub is None or low(pa, ub[0]) >= ub[1]):
                        continue
                    pair = _first_unordered(world, a, b)
                    if pair is None:
                        continue
                    cls, first, second = classify(world, *pair)
                    race = RawRace(cls, buffer, first, second, slot)
                    assert race.key(world) == key
                    found.setdefault(key, race)
    return list(found.values())


class Cuts(Protocol):
    """What the real-steps race search asks of legal.Execution (which imports this
    module): both accesses' cuts when they race on the ranks they name, else None."""

    def unordered(self, race: RawRace) -> object | None: ...


# The work of the real-steps search (find_real_races), in units of one entry of a cut: every
# rank's cut of every event of the computed calls (W x events x W x streams entries, each
# cut walked on from the one before it on its stream: legal.Execution.before), and
# PAIR_UNITS per (writer, writer, owner) of a pair of accesses that ``_real_race`` may
# compare (it asks both cuts and orders them: measured 20 to 45 times a cut entry on
# this project's shared 2-core machine; BCAST_BESIDE_GATHER of tests/check at W = 64,
# 122,880 cut entries and 104,832 compared, 5 s; LINE_READ at W = 64, 294,912 and
# 1,433, 0.37 s). The checker asks it before the search: past the limit a W is refused
# (schedule-too-large, docs/language.md "Limits"), not searched for minutes.
MAX_REAL_WORK = 1_000_000
PAIR_UNITS = 20


def real_work(world: World) -> tuple[int, int]:
    """(cut entries, pair units) of ``find_real_races`` at this W (``MAX_REAL_WORK``),
    before any cut is made: PAIR_UNITS per (writer of a, writer of b, owner) that
    ``_real_race`` may compare for a pair of groups of one instance (one of them
    writing), bounded from each access's writers and the (writer, owner) it is made at
    (the ``_translations`` masks): W^2 for two stores of different partitions made at
    every owner, W for a local access beside a store or two of one partition, 1 for two
    local accesses (x W owners at most)."""
    w = int(world.world)
    cuts = w * world.calls * world.n * w * world.streams
    pairs = 0
    for buffer, signatures in _touching(world).items():
        if buffer not in world.program.shared:
            continue
        # per (event, access): its writers and the (writer, owner) it is made at
        sizes = []
        for j, access in signatures:
            ranks = _writers(world, access) if access.remote else [0]
            masks = [_translations(world, j, access, r) for r in ranks]
            sizes.append((len(ranks), sum(w if m == -1 else m.bit_count() for m in masks),
                          access))
        for _, calls in _instances(world, buffer):
            groups = [s for _ in calls for s in sizes]
            for i, (na, ma, xa) in enumerate(groups):
                for nb, mb, xb in groups[i + 1:]:
                    if xa.kind != "write" and xb.kind != "write":
                        continue
                    one = (not xa.remote and not xb.remote) or (
                        xa.remote and xb.remote
                        and xa.region.partition == xb.region.partition)  # type: ignore[union-attr]
                    pairs += min(ma, mb) if one else min(nb * ma, na * mb)
    return cuts, pairs * PAIR_UNITS

def find_real_races(world: World, execution: Cuts,
                    keys: set[tuple[str, str, str, str, str]] | None = None) -> list[RawRace]:
    """One race per (class, buffer, step pair), decided on the ranks' real steps under
    their ``when:`` guards (legal.Execution), where the symmetric model's clocks stop at
    a cycle of waits those guards cut: every rank finishes every call there, so every
    event is searched (not only the model's live ones), on every owner's instance (the
    ranks differ: no rotation stands for another), each pair of conflicting accesses
    (``_rank_pairs``, every common writer) that the program makes (``made``: a perm's
    store at its table, a broadcast's from its root, a shift's src read where it sends)
    ordered iff one ends before the other starts in the other's cut
    (``Execution.unordered``). A race is kept with the first pair found, its
    translation the checker's counterexample as it is. ``keys``: those races only (a
    race of the model to place on pairs the real steps leave unordered)."""
    found: dict[tuple[str, str, str, str, str], RawRace] = {}
    topo = torus(shape_of(world.world))
    for buffer, signatures in sorted(_touching(world).items()):
        if buffer not in world.program.shared or (
                keys is not None and buffer not in {k[2] for k in keys}):
            continue
        for slot, calls in _instances(world, buffer):
            groups = [(call, j, access) for call in calls for j, access in signatures]
            for i, a in enumerate(groups):
                for b in groups[i + 1:]:
                    if a[2].kind != "write" and b[2].kind != "write":
                        continue
                    key = _pair_key(world, buffer, a, b)
                    if key in found or (keys is not None and key not in keys):
                        continue
                    race = _real_race(world, execution, topo, buffer, slot, a, b)
                    if race is not None:
                        found[key] = race
    return list(found.values())


def _real_race(world: World, execution: Cuts, topo: Torus, buffer: str, slot: int | None,
               a: tuple[int, int, Access], b: tuple[int, int, Access]) -> RawRace | None:
    """The first conflicting pair of groups a and b, on any owner's instance, that the
    real steps leave unordered (``find_real_races``), else None."""
    for ra, rb in _rank_pairs(world, a, b, every=True):
        # the owners where the program makes both (review of sym26 H1: every owner was
        # tried, W^3 for a broadcast beside an all_gather, past what real_work counts)
        for owner in both_made(world, Touch(ra, a[0], a[1], a[2], 0),
                               Touch(rb, b[0], b[1], b[2], 0)):
            x = Touch(topo.add(ra, owner), a[0], a[1], a[2], owner)
            y = Touch(topo.add(rb, owner), b[0], b[1], b[2], owner)
            cls, first, second = classify(world, x, y)
            race = RawRace(cls, buffer, first, second, slot)
            if execution.unordered(race) is not None:
                return race
    return None


def both_made(world: World, x: Touch, y: Touch) -> list[int]:
    """The translations d, in increasing order, that move both x and y, accesses to rank
    0's instance, to ones the program makes on ranks where they happen (the
    ``_translations`` masks, the one definition): the owners d of their translated pair."""
    assert x.owner == 0 and y.owner == 0
    both = _translations(world, x.j, x.access, x.rank) & _translations(
        world, y.j, y.access, y.rank) & _meets(world, x.access, x.rank, y.access, y.rank)
    return _owners(both, torus(shape_of(world.world)).size)


def _owners(mask: int, size: int) -> list[int]:
    """The translations (owners) a ``_translations`` mask holds, in increasing order."""
    return list(range(size)) if mask == -1 else [d for d in range(size) if mask >> d & 1]
