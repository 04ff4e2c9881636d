"""The torch backend: every op as torch.distributed collectives plus the reference
math of ``dcpc.runtime.merge`` (gloo on CPU, NCCL on GPU). It is the reference the
Triton backends are tested against, and the fallback across nodes.

Layouts are the Triton kernels' (docs/internals.md): an all_gather along ``dim``
sees ``src`` as [outer, rows, row_len]; an all_to_all as [outer, W, part]. Staging
buffers are preallocated by the module; the merge math allocates temporaries.

Every collective runs on its slot's own process group (``SlotGroup``): collectives pair
by issue order within a group, so one group per slot keeps a slot's collectives from
pairing with another slot's when ranks issue the slots in different orders (NCCL: the
slots' streams then run independently; gloo blocks the host thread, so crossed slots
stop with ``DcpcCollectiveError`` after ``timeout_s`` instead of pairing).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dcpc.exprs import ragged_slot
from dcpc.numerics import ScaleRule, ieee_max
from dcpc.runtime import merge
from dcpc.runtime.errors import DcpcArgumentError, DcpcCollectiveError
from dcpc.topology import along, perm_sources

# dtypes a backend may not move (gloo has no fp8: "Invalid scalar type", or a hang):
# every payload goes over the wire as its bytes
_AS_BYTES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                  "float8_e4m3fnuz", "float8_e5m2fnuz")
                      if hasattr(torch, n))


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a collective sends it: a uint8 view of an fp8 tensor (data movement
    only: every reduction here gathers, then adds in fp32), else ``t`` itself."""
    return t.view(torch.uint8) if t.dtype in _AS_BYTES else t


@dataclass(frozen=True)
class SlotGroup:
    """The process group of one slot, and how long a collective may wait on the host.
    ``rank``: this rank's index in ``group`` (a team member index for a team op's group);
    ``me`` and ``peers``: this rank and the other members as the module numbers them
    (what an error names); ``members``: every member as the module numbers it, in member
    order (a team's; empty: the group's own numbering, member i is rank i)."""

    group: Any
    slot: int
    rank: int
    timeout: timedelta | None  # gloo: the module's timeout_s; NCCL: None (stream-ordered)
    me: int = 0
    peers: tuple[int, ...] = ()
    members: tuple[int, ...] = ()
    # the waits written before their puts whose message an earlier wait of their span
    # received (``shift``'s ``early``): their own wait receives nothing
    received: set[str] = field(default_factory=set, compare=False, hash=False)

    def rank_of(self, member: int) -> int:
        """The module's rank of member ``member`` (what an error names)."""
        return self.members[member] if self.members else member

    # what an op's own torch body (``OpDef.torch``, copied into the generated module: it
    # imports no runtime) calls: dcpc.ops.iface.TorchComm
    def wait(self, work: Any, op: str) -> None:
        """Wait for an async collective's ``work`` (within the timeout on gloo: else
        ``DcpcCollectiveError`` naming ``op``, this rank, the slot and the peers)."""
        _wait(self, work, op)

    def wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a collective sends it (``wire``: an fp8 tensor as its bytes)."""
        return wire(t)

    def refuse(self, message: str) -> None:
        """Refuse a call's arguments: ``DcpcArgumentError(message)``."""
        raise DcpcArgumentError(message)


_SLOT_GROUPS: dict[tuple[tuple[int, ...], int], Any] = {}  # (global ranks, slot) -> group


def slot_groups(group: Any, rank: int, world: int, slots: int, timeout_s: float | None,
                owner: str) -> list[SlotGroup]:
    """One ``SlotGroup`` per slot: slot 0 uses ``group``, every other slot a group of the
    same ranks, made by the first construction over these ranks (in the same order on
    every rank; only the group's members take part: ``use_local_synchronization``) and
    reused by later ones: gloo groups cannot be torn down safely while a peer may still
    connect, so one per slot and rank set lives as long as the process."""
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    groups = [group] * min(slots, 1)
    if world > 1 and slots > 1:
        ranks = dist.get_process_group_ranks(group)
        for slot in range(1, slots):
            new = _SLOT_GROUPS.get((tuple(ranks), slot))
            if new is None:
                new = dist.new_group(ranks, use_local_synchronization=True)
                _SLOT_GROUPS[(tuple(ranks), slot)] = new
            if [dist.get_global_rank(new, r) for r in range(world)] != [
                dist.get_global_rank(group, r) for r in range(world)
            ]:
                raise DcpcArgumentError(
                    f"{owner}: the group's ranks are not in ascending global order "
                    f"({ranks}): a per-slot group would number them otherwise; use a group "
                    "made by torch.distributed.new_group"
                )
            groups.append(new)
    elif slots > 1:
        groups = [group] * slots
    peers = tuple((rank + k) % world for k in range(1, world))
    return [SlotGroup(g, slot, rank, timeout, rank, peers) for slot, g in enumerate(groups)]


def _wait(comm: SlotGroup, work: Any, op: str) -> None:
    if comm.timeout is None:
        work.wait()
        return
    try:
        work.wait(comm.timeout)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or ["?"])[0][:200]
        raise DcpcCollectiveError(op, comm.me, comm.slot, comm.timeout, first,
                                  comm.peers) from None


def _all_to_all_single(comm: SlotGroup, out: torch.Tensor, inp: torch.Tensor,
                       world: int) -> None:
    if world == 1:
        out.copy_(inp)
    else:
        _wait(comm, dist.all_to_all_single(wire(out), wire(inp), group=comm.group,
                                           async_op=True), "all_to_all")


def all_gather(
    comm: SlotGroup,
    src: torch.Tensor,
    dst: torch.Tensor,
    stage: torch.Tensor,
    outer: int,
    rows: int,
    row_len: int,
    interleave: int,
    world: int,
) -> None:
    """Row j of rank r -> row (j // I) * W * I + r * I + j % I of every rank's dst."""
    n = outer * rows * row_len
    if n == 0:  # an empty call (T = 0, dcpc.engines' marker): nothing moves; I may be 0
        return
    staged = stage[: world * n]
    if world == 1:
        staged.copy_(src.reshape(-1))
    else:
        _wait(comm, dist.all_gather_into_tensor(wire(staged), wire(src.reshape(-1)),
                                                group=comm.group, async_op=True), "all_gather")
    blocks = rows // interleave
    dst.view(outer, blocks, world, interleave, row_len).copy_(
        staged.view(world, outer, blocks, interleave, row_len).permute(1, 2, 0, 3, 4)
    )


def all_to_all(
    comm: SlotGroup,
    src: torch.Tensor,
    dst: torch.Tensor,
    send: torch.Tensor,
    outer: int,
    part: int,
    world: int,
) -> None:
    """Part j of src ([outer, W, part]) lands in dst[rank] ([W, outer, part]) on rank j."""
    staged = send[: outer * world * part]
    staged.view(world, outer, part).copy_(src.reshape(outer, world, part).transpose(0, 1))
    # dst may hold more rows than the team (a team op's implicit via: [W, ...]): the first
    _all_to_all_single(comm, dst.reshape(-1)[: world * outer * part], staged, world)


def reduce_scatter(
    comm: SlotGroup,
    src: torch.Tensor,
    via: torch.Tensor,
    dst: torch.Tensor,
    send: torch.Tensor,
    acc: torch.Tensor,
    outer: int,
    part: int,
    world: int,
    scale: torch.Tensor | None = None,
) -> None:
    """Sum over ranks in fp32 (the kernels' accumulation); rank j keeps part j, rounded
    once into dst's dtype (``scale``: quantized, see merge.quantize)."""
    all_to_all(comm, src, via, send, outer, part, world)
    sum_parts(via, dst, acc, outer, part, world, scale)


def sum_parts(via: torch.Tensor, dst: torch.Tensor, acc: torch.Tensor, outer: int,
              part: int, world: int, scale: torch.Tensor | None = None) -> None:
    """reduce_scatter's local half: the W parts that landed in ``via`` summed in fp32
    into dst (a split reduce_scatter's wait; its put is ``all_to_all`` into via)."""
    total = acc[: outer * part]
    rows = via.reshape(-1)[: world * outer * part].view(world, outer * part)  # the team's
    torch.sum(rows, dim=0, dtype=torch.float32, out=total)
    dst.reshape(-1).copy_(total if scale is None else merge.quantize(total, scale, dst.dtype))


def _mask(
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    tokens: int,
    world: int,
    interleave: int,
) -> torch.Tensor | None:
    if seq_lens is None or query_start_loc is None:
        return None
    if interleave == 0:  # local lengths [B, W]
        return merge.empty_mask_local(seq_lens, query_start_loc, tokens)
    return merge.empty_mask(seq_lens, query_start_loc, tokens, world, interleave)


def lse_combine(
    o: torch.Tensor,
    lse: torch.Tensor,
    dst: torch.Tensor,
    dst_lse: torch.Tensor | None,
    base: str,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    interleave: int,
    world: int,
    scale: torch.Tensor | None = None,
) -> None:
    masked = _mask(seq_lens, query_start_loc, lse.shape[1], world, interleave)
    out, total = merge.lse_combine(o, lse, base, masked)
    dst.copy_(out if scale is None else merge.quantize(out, scale, dst.dtype))
    if dst_lse is not None:
        dst_lse.copy_(total)


def lse_correct(
    o: torch.Tensor,
    lse_all: torch.Tensor,
    dst: torch.Tensor,
    dst_lse: torch.Tensor | None,
    base: str,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    interleave: int,
    world: int,
    rank: int,
    scale: torch.Tensor | None = None,
) -> None:
    masked = _mask(seq_lens, query_start_loc, lse_all.shape[1], world, interleave)
    out, total = merge.lse_correct(o, lse_all, rank, base, masked)
    dst.copy_(out if scale is None else merge.quantize(out, scale, dst.dtype))
    if dst_lse is not None:
        dst_lse.copy_(total)


def barrier(comm: SlotGroup, token: torch.Tensor, world: int) -> None:
    """Every rank waits for every rank (an all_reduce: device-ordered, graph-capturable)."""
    if world > 1:
        _wait(comm, dist.all_reduce(token, group=comm.group, async_op=True), "barrier")


def shift(comm: SlotGroup, src: torch.Tensor, dst: torch.Tensor, offset: int, rank: int,
          world: int, wrap: bool = True, perm: list[int] | None = None,
          half: str | None = None, name: str | None = None,
          early: Sequence[tuple[str, torch.Tensor, int, bool, list[int] | None]] = ()
          ) -> None:
    """dst on rank r + offset = src of rank r: one send and one receive per rank.
    ``wrap`` False: no send past either end of 0 .. W-1, no receive from past it (dst
    kept). ``perm`` (the destination of each rank, -1: none; the offset unused): dst on
    rank perm[r] = src of rank r; a rank that is no source sends nothing, one that is
    no destination receives nothing (dst kept), a fixed point copies locally.
    ``half``: "recv" (a shift's wait written before its put: receive only) or "send"
    (that put: send only, its receiver posted the receive at its wait); a chain only
    (the checker refuses a wait-first ring), so no local copy. ``early`` (at such a
    wait, ``name`` its step): the later waits of its span, on this group, whose puts
    come before this one's put, in the order of those puts, each as (name, dst, offset,
    wrap, perm): gloo and NCCL match the messages between two ranks in order, so where
    one's source on this rank is this wait's, its message is first on the wire: it is
    received here, into its own dst (in flight: nothing touches it until its wait, the
    checker's rule), and its own wait receives nothing."""
    if half == "recv" and name is not None:
        if name in comm.received:  # an earlier wait received it
            comm.received.discard(name)
            return
        mine = source(rank, world, offset, wrap, perm)
        for other, into, k, w, table in early:
            if (mine not in (None, rank) and other not in comm.received
                    and source(rank, world, k, w, table) == mine):
                _exchange(comm, [dist.P2POp(dist.irecv, wire(into),
                                            dist.get_global_rank(comm.group, mine),
                                            comm.group)])
                comm.received.add(other)
    if perm is not None:
        _permute(comm, src, dst, rank, perm, half)
        return
    to, back = along(rank, world, offset, wrap), source(rank, world, offset, wrap, None)
    if wrap and to == rank:  # W divides the offset: a local copy
        dst.copy_(src)
        return
    ops = []
    if half != "recv" and to is not None:
        ops.append(dist.P2POp(dist.isend, wire(src.contiguous()),
                              dist.get_global_rank(comm.group, to), comm.group))
    if half != "send" and back is not None:
        ops.append(dist.P2POp(dist.irecv, wire(dst), dist.get_global_rank(comm.group, back),
                              comm.group))
    _exchange(comm, ops)


def source(rank: int, world: int, offset: int, wrap: bool, perm: list[int] | None
           ) -> int | None:
    """The member a shift's receive on member ``rank`` takes from (``rank`` itself: a
    local copy), or None (it receives nothing), by dcpc.topology's ``along`` and
    ``perm_sources``: what ``shift``, ``_permute`` and the early receive use."""
    if perm is not None:
        found = perm_sources(perm)[rank]
        return None if found < 0 else found
    return along(rank, world, -offset, wrap)


def _exchange(comm: SlotGroup, ops: list[Any]) -> None:
    """Post ``ops`` (point-to-point) at once and wait for each."""
    for work in dist.batch_isend_irecv(ops) if ops else ():
        _wait(comm, work, "shift")


def _permute(comm: SlotGroup, src: torch.Tensor, dst: torch.Tensor, rank: int,
             perm: list[int], half: str | None = None) -> None:
    """``shift`` with a perm table: one send to perm[rank], one receive from its source."""
    to = perm[rank]
    back = source(rank, len(perm), 0, True, perm)
    if to == rank:  # a fixed point: a local copy, no message
        dst.copy_(src)
        return
    ops = []
    if to >= 0 and half != "recv":
        ops.append(dist.P2POp(dist.isend, wire(src.contiguous()),
                              dist.get_global_rank(comm.group, to), comm.group))
    if back is not None and half != "send":
        ops.append(dist.P2POp(dist.irecv, wire(dst), dist.get_global_rank(comm.group, back),
                              comm.group))
    _exchange(comm, ops)


def all_reduce(
    comm: SlotGroup,
    src: torch.Tensor,
    via: torch.Tensor,
    dst: torch.Tensor,
    acc: torch.Tensor,
    numel: int,
    world: int,
    reduce: int,
    scale: torch.Tensor | None = None,
) -> None:
    """Every rank's src lands in via[rank] ([W, numel]) of every rank; then dst is the
    reduction over p = 0 .. W-1 in fp32 (``reduce`` 0: sum, 1: max), the same on every
    rank (the kernels' order and accumulation: a sum starts from +0, so a sum of -0s is
    +0 as on every backend; ``scale``: quantized, see merge.quantize)."""
    if numel == 0:
        if scale is not None:
            merge.checked_scale(scale)  # refused on every rank, as the kernels
        return
    staged = via.reshape(-1)[: world * numel]
    if world == 1:
        staged.copy_(src.reshape(-1))
    else:
        _wait(comm, dist.all_gather_into_tensor(wire(staged), wire(src.reshape(-1)),
                                                group=comm.group, async_op=True), "all_reduce")
    total = acc[:numel]
    parts = staged.view(world, numel)
    if reduce == 0:
        total.zero_()  # the kernels' start: a sum of -0s is +0
        for p in range(world):  # rank order, as the kernels add
            total.add_(parts[p].to(torch.float32))
    else:  # exact in any order; NaN wins, +0 above -0 (numerics.ieee_max)
        total.copy_(ieee_max(parts.to(torch.float32)))
    dst.reshape(-1).copy_(total if scale is None else merge.quantize(total, scale, dst.dtype))


def all_to_all_concat(
    comm: SlotGroup,
    src: torch.Tensor,
    dst: torch.Tensor,
    send: torch.Tensor,
    recv: torch.Tensor,
    outer: int,
    part: int,
    block: int,
    world: int,
) -> None:
    """all_to_all with split_dim/concat_dim: part j of src ([outer, W, part]) lands on
    rank j as block ``rank`` along concat_dim, i.e. dst seen as [n, W, block] gets it at
    [:, rank] (``block``: the part's size from concat_dim on)."""
    numel = outer * part
    if numel == 0:
        return
    staged = recv[: world * numel]
    all_to_all(comm, src, staged, send, outer, part, world)  # staged: [W, numel]
    dst.reshape(numel // block, world, block).copy_(
        staged.view(world, numel // block, block).transpose(0, 1))


def all_reduce_lse(
    comm: SlotGroup,
    o: torch.Tensor,
    lse: torch.Tensor,
    via_o: torch.Tensor,
    via_lse: torch.Tensor,
    dst: torch.Tensor,
    dst_lse: torch.Tensor | None,
    base: str,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    interleave: int,
    world: int,
    scale: torch.Tensor | None = None,
) -> None:
    """all_reduce with reduce: lse: every rank's [o, lse] lands in via[rank] of every rank
    (all_gather), then lse_combine's merge of via on every rank."""
    for src, recv in ((o, via_o), (lse, via_lse)):
        n = src.numel()
        if world == 1:
            recv.reshape(-1)[:n].copy_(src.reshape(-1))
        elif n:
            _wait(comm, dist.all_gather_into_tensor(wire(recv.reshape(-1)), wire(src.reshape(-1)),
                                                    group=comm.group, async_op=True),
                  "all_reduce")
    lse_combine(via_o, via_lse, dst, dst_lse, base, seq_lens, query_start_loc, interleave,
                world, scale)


def broadcast(comm: SlotGroup, src: torch.Tensor, dst: torch.Tensor, root: int,
              world: int) -> None:
    """Rank ``root``'s src (a team index) lands in every rank's dst."""
    if root >= world:
        raise DcpcArgumentError(f"broadcast: root {root} is not a rank of a group of {world}")
    if comm.rank == root:
        dst.copy_(src)
    if world > 1 and dst.numel():
        _wait(comm, dist.broadcast(wire(dst), src=dist.get_global_rank(comm.group, root),
                                   group=comm.group, async_op=True), "broadcast")


def reduce(
    comm: SlotGroup,
    src: torch.Tensor,
    via: torch.Tensor,
    dst: torch.Tensor,
    acc: torch.Tensor,
    numel: int,
    world: int,
    reduce: int,
    root: int,
    scale: torch.Tensor | None = None,
) -> None:
    """all_reduce's reduction (rank order, fp32) on rank ``root``; 0 in dst elsewhere
    (every rank's src reaches every rank here: a reference backend, not a tuned one);
    ``scale``: every rank's is checked, the root's quantizes (merge.quantize)."""
    if root >= world:
        raise DcpcArgumentError(f"reduce: root {root} is not a rank of a group of {world}")
    all_reduce(comm, src, via, dst, acc, numel, world, reduce, scale)
    if comm.rank != root:
        dst.zero_()


def ragged_all_to_all(
    comm: SlotGroup,
    src: torch.Tensor,
    counts: torch.Tensor,
    dst: torch.Tensor,
    recv_counts: torch.Tensor | None,
    capacity: int,
    world: int,
    step: str,
    cast: int = 0,
    scale: torch.Tensor | None = None,
    more: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    groups: int = 1,
    combine: bool = False,
    group: int | None = None,
    rule: ScaleRule = "dcpc",
    offset: int | None = None,
    index: torch.Tensor | None = None,
) -> None:
    """Rows [0, counts[j]) of block j of src ([W, cap, ...]) land in dst[rank] on rank j,
    with counts[j] in recv_counts[rank]; rows of dst past a count are left alone. A count
    over capacity or negative raises before anything is sent (errors.over_capacity).
    ``more``: further (src, dst) payloads, the same rows of each, never cast.
    ``cast`` (the kernel's CAST, dcpc/ops/cast.py): 1 quantise per token (the row scales
    land in ``scale[rank]`` on rank j), 2 quantise by ``scale[0]``, 3 dequantise by the
    sender's ``scale[j, row]``, 4 dequantise by ``scale[0]``; ``group`` (1 and 3): one
    scale per ``group`` channels of a row (``scale[..., c // group]``); ``rule`` (1): how
    the scales are made and the values round (dcpc.numerics.SCALE_RULES).
    ``groups`` G > 1 (dcpc/ops/ragged_all_to_all.py): slots of ``capacity`` rows per
    (peer, group); src [W, G*cap] and counts [W, G] land as dst [G, W*cap] and
    recv_counts [G, W], or (``combine``) src [G, W*cap], counts [G, W] as dst [W, G*cap],
    recv_counts [W, G].
    ``offset`` k (one peer per rank): only the slots for member rank + k are sent, only
    those from rank - k land (dst's and recv_counts' others are left alone); every member
    still takes part in the one exchange (the other parts travel empty).
    ``index`` (src's [W, cap] integers, DeepEP's src_info): live row i of a slot lands at
    row index[slot, i] of its destination slot (in row order: of two rows placed alike
    the later stays); one outside [0, cap) raises before anything is sent
    (errors.outside_slot). ``recv_counts`` None: no count is stored (the counts still
    cross the wire: this backend lands the rows by them)."""
    from dcpc.runtime.errors import outside_slot, over_capacity

    sent = counts.reshape(-1).to(torch.int32)
    # the wire's order: (peer, group), peer-major; the slot each is in src/counts and dst
    pairs = list(itertools.product(range(world), range(groups)))
    out_of = [ragged_slot(combine, world, groups, comm.rank, j, g)[0] for j, g in pairs]
    into = [ragged_slot(combine, world, groups, p, comm.rank, g)[1] for p, g in pairs]
    # the wire positions this rank sends and lands (one peer: rank + k's, rank - k's)
    sends = [i for i, (j, _) in enumerate(pairs)
             if offset is None or j == (comm.rank + offset) % world]
    lands = [i for i, (p, _) in enumerate(pairs)
             if offset is None or p == (comm.rank - offset) % world]
    if offset is not None:  # the slots for other peers: not sent (empty on the wire)
        sent = torch.zeros_like(sent).index_copy(
            0, torch.tensor([out_of[i] for i in sends], dtype=torch.long),
            sent[[out_of[i] for i in sends]])
    over = torch.nonzero((sent > capacity) | (sent < 0)).flatten().tolist()
    if over:  # counts is indexed by member; the error names module ranks
        i = over[0]
        j = pairs[out_of.index(i)][0]
        raise over_capacity(step, comm.me, comm.rank_of(j), int(sent[i]), capacity, index=i)
    places = None if index is None else index.reshape(world * groups, capacity).to(torch.int64)
    for i in [] if places is None else sends:  # before anything is sent, as a bad count
        row = places[out_of[i], :int(sent[out_of[i]])]
        outside = row[(row < 0) | (row >= capacity)]
        if len(outside):
            raise outside_slot(step, comm.me, comm.rank_of(pairs[i][0]), int(outside[0]),
                               capacity, index=out_of[i])
    if cast in (2, 4) and scale is not None:
        merge.checked_scale(scale)  # before anything is sent, as a bad count
    got = torch.empty(world * groups, dtype=torch.int32, device=sent.device)
    _all_to_all_single(comm, got, sent[out_of], world)
    x, row_scales = _cast(src.contiguous(), cast, scale, dst.dtype, group, rule)
    landed = [(x, dst)] + [(extra.contiguous(), extra_dst) for extra, extra_dst in more]
    if row_scales is not None and scale is not None:
        landed.append((row_scales, scale))
    at = None  # the row each landed row goes to: index's, travelling as the rows do
    if places is not None:
        at = torch.empty(world * groups, capacity, dtype=torch.int64, device=dst.device)
        _all_to_all_single(comm, at.reshape(-1), places[out_of].reshape(-1), world)
    for payload, target in landed:  # as is past the first: ids, weights, bit for bit
        staged = torch.empty(world * groups, capacity, *payload.shape[2:], dtype=target.dtype,
                             device=target.device)
        slots = payload.view(world * groups, capacity, *payload.shape[2:])
        _all_to_all_single(comm, staged.reshape(-1), slots[out_of].reshape(-1), world)
        slots = target.view(world * groups, capacity, *target.shape[2:])
        for k in lands:
            n = int(got[k])
            if at is None:
                slots[into[k], :n].copy_(staged[k, :n])
            for i in range(n) if at is not None else ():  # in row order: the later stays
                slots[into[k], int(at[k, i])].copy_(staged[k, i])
    if recv_counts is not None:
        recv_counts.view(-1)[[into[k] for k in lands]] = got[lands].to(recv_counts.dtype)


def weighted_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    index: torch.Tensor | None,
    dst: torch.Tensor,
    step: str,
    scale: torch.Tensor | None = None,
) -> None:
    """dst[t] = sum_k weights[t, k] * row(t, k) in fp32, k in order (the kernel's), each
    term fused into the sum (fma: the product and sum in float64, rounded once to fp32; a
    float64 sum that needs more bits than float64 has rounds twice), one rounding into
    dst; row(t, k) = x's row index[t, k] (< 0: none) or x[t, k]; ``scale``: quantized
    (merge.quantize)."""
    from dcpc.runtime.errors import bad_index

    if scale is not None:
        merge.checked_scale(scale)

    rows = x.reshape(-1, x.shape[-1])
    weights = weights.reshape(-1, weights.shape[-1])  # tokens over [*T]
    tokens, topk = weights.shape
    if index is None:
        index = torch.arange(tokens * topk, device=x.device).reshape(tokens, topk)
    index = index.to(torch.int64).reshape(tokens, topk)
    past = torch.nonzero((index >= len(rows)).any(dim=1)).flatten().tolist()
    if past:
        t = past[0]
        raise bad_index(step, None, t, int(index[t].max()), len(rows))
    acc = torch.zeros(tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    for k in range(topk):  # acc = fma(w, row, acc), the kernel's: in float64, one rounding
        live = (index[:, k] >= 0)[:, None]
        w = torch.where(live, weights[:, k, None].double(), 0.0)
        row = torch.where(live, rows[index[:, k].clamp(min=0)].double(), 0.0)
        acc = (w * row + acc.double()).float()
    out = acc if scale is None else merge.quantize(acc, scale, dst.dtype)
    dst.copy_(out.reshape(dst.shape))


def _cast(x: torch.Tensor, cast: int, scale: torch.Tensor | None, dtype: torch.dtype,
          group: int | None = None, rule: ScaleRule = "dcpc"
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ([..., row]) cast as the kernels' CAST does (dcpc/ops/cast.py), in ``dtype``,
    and the per-row (per ``group`` channels) scales a per-token quantise sends along."""
    from dcpc.numerics import quantise_tokens, spread

    row_scales = None
    if cast == 1:
        x, row_scales = quantise_tokens(x, merge.fp8_format(dtype), group, rule)
    elif cast == 2:
        assert scale is not None
        x = merge.quantize(x, scale, dtype)
    elif cast in (3, 4):
        assert scale is not None
        s = spread(scale.float(), group) if cast == 3 else merge.checked_scale(scale)
        x = x.float() * s
    return x.to(dtype), row_scales


def cast_all_to_all(
    comm: SlotGroup,
    src: torch.Tensor,
    dst: torch.Tensor,
    rows: int,
    world: int,
    cast: int,
    scale: torch.Tensor,
    group: int | None = None,
    rule: ScaleRule = "dcpc",
) -> None:
    """An all_to_all with a cast (one payload along dim 0): part j of src (``rows`` rows)
    lands cast in dst[rank] on rank j; a per-token quantise's scales in scale[rank]."""
    x, row_scales = _cast(src.contiguous(), cast, scale, dst.dtype, group, rule)
    _all_to_all_single(comm, dst.reshape(-1), x.reshape(-1), world)
    if row_scales is not None:
        got = torch.empty_like(row_scales).reshape(-1)
        _all_to_all_single(comm, got, row_scales.reshape(-1), world)
        scale.reshape(-1).copy_(got)
