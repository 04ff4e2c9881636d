"""An access tracer for the Triton interpreter: what the emitted kernels really touch,
compared with what the plan says each step reads and writes (issue 22, item 11).

The happens-before checker and the execution oracle both analyse the plan's effects
(``StepPlan.effects`` and ``.sync``, from the semantics table), so a wrong table row is
invisible to both. This module runs a schedule's generated module for real (backend
``local``: every rank a thread of this process, so every rank's addresses are seen) and
records every load, store and atomic of every kernel program: the address, mapped to
(buffer, owning rank, slot, element), and the phase of its program, ``before`` its
signal (or the whole kernel, for a step that does not signal) or ``after`` it (once a
program has published its signal, its next data access follows its wait: the spin
touches signal memory only; a launch with ``PUSH=False`` runs after a wait entirely; a
launch that waits without signalling, a split ``phase: wait``, is ``after`` from its
first poll, an acquire of a signal cell).

``check`` then demands, for every step call on every rank:

- every access lies in a buffer (module-owned memory of some rank, the call's engine
  tensors, or the signal machinery): else ``outside every buffer``;
- every data access has an effect with the same buffer, kind (an atomic is a read and a
  write) and phase; a store into a peer's instance needs a region effect, and every
  element a rank stores under a region effect lies in that rank's part (index /
  block / interleave of the region's axis); a load from a peer's instance needs a
  region effect too (a remote read: pull); a symmetric buffer is touched in the
  call's slot only;
- every effect of the table happened somewhere in the run (on some rank, some call); an
  effect marked ``either`` (listed before the signal and after the wait: the phase
  depends on the launch) in one of its two phases.

Hooks are installed while ``tracing()`` is active and removed after: the interpreter
builder's memory ops, its program index, its launcher, and the module's ``_bind`` (to
learn each call's step, slot, sizes and engine tensors).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dcpc.codegen.plan import Plan, StepPlan
from dcpc.lang.mesh import shape_of, torus

SYNC = "<sync>"  # signal words, epochs, error words, pointer tables
OUTSIDE = "<outside every buffer>"
BEFORE, AFTER = "before", "after"


@dataclass
class Call:
    """One method call on one rank: its step, slot, sizes."""

    rank: int
    step: str
    slot: int
    env: dict[str, int]
    engine: list[tuple[int, int, str, int]] = field(default_factory=list)  # start, end, name, size
    launches: int = 0  # kernel launches begun
    xchg: int = 0  # atomic exchanges made: signals (and failure flags) published


@dataclass
class Range:
    start: int
    end: int
    buffer: str
    owner: int  # the rank whose instance it is (-1: sync memory)
    slot: int  # -1: every slot (shared) or not applicable
    itemsize: int


@dataclass
class Trace:
    """The raw record, (call id, phase, kind) -> addresses, and what maps addresses to
    buffers: the calls (with their engine tensors) and every rank's module memory. The
    addresses are resolved after the run (``accesses``), when every rank's memory is
    known: a rank may store into a peer whose module has not been seen yet."""

    calls: list[Call] = field(default_factory=list)
    raw: dict[tuple[int, str, str], list[np.ndarray]] = field(default_factory=dict)
    programs: dict[str, int] = field(default_factory=dict)
    ranges: list[Range] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _seen: set[int] = field(default_factory=set)  # modules whose memory is registered
    # per raw key, the address sets already recorded: a wait's spin polls the same words
    # each iteration, and a peer that is slow under load made a traced run grow without
    # bound (a CI worker reached 23 GB); a repeat adds nothing to the union taken later
    _recorded: dict[tuple[int, str, str], set[bytes]] = field(default_factory=dict)
    # rank -> its module (the last seen), for a failure's report; cleared when tracing() ends
    modules: dict[int, Any] = field(default_factory=dict)

    def add_module(self, module: Any) -> None:
        with self.lock:
            if id(module) in self._seen:
                return
            self._seen.add(id(module))
            self.modules[module.rank] = module
            for name, per_slot in module._local.items():
                buf = module.BUFFERS[name]  # one instance for all slots: shared, persist
                shared = buf.kind == "shared" or getattr(buf, "persist", False)
                for slot, flat in enumerate(per_slot):
                    self._add(flat, name, module.rank, -1 if shared else slot)
            for tables in module._peers.values():
                for t in tables:
                    self._add(t, SYNC, -1, -1)
            bank = module._bank
            words_end = bank.sig.data_ptr() + bank.sig.numel() * 8
            self.ranges.append(Range(bank.flags.data_ptr(), words_end, SYNC, -1, -1, 8))
            for t in (bank.sig_ptrs, bank.epochs, bank.errors):
                self._add(t, SYNC, -1, -1)
            for t in getattr(module, "_team_cache", {}).values():  # teams' pointer tables
                if isinstance(t, torch.Tensor):
                    self._add(t, SYNC, -1, -1)

    def _add(self, t: torch.Tensor, name: str, owner: int, slot: int) -> None:
        end = t.data_ptr() + t.numel() * t.element_size()
        if any(r.start == t.data_ptr() and r.buffer == name for r in self.ranges):
            return  # a shared buffer's one allocation, listed per slot
        self.ranges.append(Range(t.data_ptr(), end, name, owner, slot, t.element_size()))

    def record(self, state: _Thread, kind: str, addrs: np.ndarray) -> None:
        """Addresses of one memory op of the current program (masked lanes dropped)."""
        if state.call is None or state.trace is not self or addrs.size == 0:
            return  # outside a call of this trace (a thread's state from an earlier one)
        addrs = np.unique(addrs.astype(np.uint64).ravel())
        key = (state.call_id, state.phase, kind)
        digest = addrs.tobytes()
        with self.lock:
            recorded = self._recorded.setdefault(key, set())
            if digest in recorded:
                return
            recorded.add(digest)
            self.raw.setdefault(key, []).append(addrs)

    def progress(self, world: int, plan: Plan | None = None) -> str:
        """Where each rank got to, by its last call: for a run that failed or hung. With
        ``plan``, each rank's signal bank for its last step (``_bank_words``): the epoch
        each of its programs is at on the step's own channel (what it signalled, or
        waits for) and the epoch in the word each peer's program signalled into this
        rank on the channel the step polls (what arrived): a peer whose word holds the
        awaited epoch signalled it (the wait missed it), one whose word is below it
        never got there (a stall or a slow peer)."""
        last: dict[int, int] = {}
        for cid, call in enumerate(self.calls):
            last[call.rank] = cid
        steps = {s.name: s for s in plan.steps} if plan is not None else {}
        lines = []
        for rank in range(world):
            if rank not in last:
                lines.append(f"  rank {rank}: no call yet")
                continue
            c = self.calls[last[rank]]
            made = sum(1 for x in self.calls if x.rank == rank)
            lines.append(f"  rank {rank}: call {made} of its own (trace call {last[rank]}): "
                         f"step '{c.step}' slot {c.slot}, {c.launches} launch(es) begun, "
                         f"{c.xchg} atomic exchange(s) (signals, flags) made")
            step, module = steps.get(c.step), self.modules.get(rank)
            if step is not None and module is not None and (step.sync.signal or step.sync.wait):
                lines.append("    " + _bank_words(module, step, c.slot, world))
        return "\n".join(lines)

    def accesses(self) -> dict[tuple, np.ndarray]:
        """(call id, phase, kind, buffer, owner, slot) -> element offsets: the call's own
        engine tensors first, then module memory (owner -1 and slot -1: not applicable)."""
        ranges = sorted(self.ranges, key=lambda r: r.start)
        starts = np.array([r.start for r in ranges], dtype=np.uint64)
        out: dict[tuple, list[np.ndarray]] = {}
        for (cid, phase, kind), parts in self.raw.items():
            call = self.calls[cid]
            addrs = np.unique(np.concatenate(parts))
            left = np.ones(addrs.shape, dtype=bool)
            for start, end, name, itemsize in call.engine:
                hit = left & (addrs >= start) & (addrs < end)
                if hit.any():
                    offs = (addrs[hit] - np.uint64(start)) // np.uint64(itemsize)
                    out.setdefault((cid, phase, kind, name, call.rank, -1), []).append(offs)
                    left &= ~hit
            rest = addrs[left]
            idx = np.searchsorted(starts, rest, side="right") - 1
            for i in np.unique(idx):
                sel = rest[idx == i]
                r = ranges[i] if i >= 0 else None
                inside = sel < np.uint64(r.end) if r is not None else np.zeros(sel.shape, bool)
                if (~inside).any():
                    out.setdefault((cid, phase, kind, OUTSIDE, -1, -1), []).append(sel[~inside])
                if r is None or not inside.any() or r.buffer == SYNC:
                    continue
                offs = (sel[inside] - np.uint64(r.start)) // np.uint64(r.itemsize)
                out.setdefault((cid, phase, kind, r.buffer, r.owner, r.slot), []).append(offs)
        return {k: np.unique(np.concatenate(v)).astype(np.int64) for k, v in out.items()}


class _Thread(threading.local):
    trace: Trace | None = None  # the trace ``call`` belongs to
    call: Call | None = None
    call_id: int = -1
    phase: str = BEFORE
    launch_phase: str = BEFORE


_active: Trace | None = None
_tls = _Thread()
_install_lock = threading.Lock()


def _masked(ptr: Any, mask: Any) -> np.ndarray:
    data = np.asarray(ptr.data)
    if mask is None:
        return data.ravel()
    return data[np.broadcast_to(np.asarray(mask.data), data.shape)].ravel()


@contextlib.contextmanager
def tracing() -> Iterator[Trace]:
    """Record every kernel access of generated modules on CPU until the block ends."""
    global _active
    from triton.runtime import interpreter

    from dcpc.runtime.module import ScheduleModule

    builder = type(interpreter.interpreter_builder)
    saved = {name: getattr(builder, name) for name in (
        "create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
        "set_grid_idx")}
    grid_call, bind = interpreter.GridExecutor.__call__, ScheduleModule._bind
    # _dcpc_wait's poll: an atomic add of 0 with acquire semantics exactly (tl.atomic_add's
    # default, acquire_release, is no poll)
    poll = (interpreter._ir.ATOMIC_OP.ADD, interpreter._ir.MEM_SEMANTIC.ACQUIRE)
    record = ScheduleModule._record

    def checked_only(self: Any, key: tuple, method: str, index: int, body: Any,
                     tensors: tuple, slot: int, call_id: Any = None) -> Any:
        """Every traced call takes the checked path (no call plan is kept, so none is
        replayed): a replay launches the recorded kernels with the same arguments but
        its own tensors, and skips ``_bind``, which names the call's tensors here."""
        return body(*tensors, slot=slot, sizes=None, call_id=call_id)
    trace = Trace()

    def load(self: Any, ptrs: Any, mask: Any, *a: Any) -> Any:
        if _active is not None:
            _active.record(_tls, "read", _masked(ptrs, mask))
        return saved["create_masked_load"](self, ptrs, mask, *a)

    def store(self: Any, ptrs: Any, value: Any, mask: Any, *a: Any) -> Any:
        if _active is not None:
            _active.record(_tls, "write", _masked(ptrs, mask))
        return saved["create_masked_store"](self, ptrs, value, mask, *a)

    def rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *a: Any) -> Any:
        if _active is not None:
            _active.record(_tls, "atomic", _masked(ptr, mask))
            if "XCHG" in str(op):  # a signal (sync.j2): the program's push is over
                _tls.phase = AFTER
                if _tls.call is not None and _tls.trace is _active:
                    with _active.lock:
                        _tls.call.xchg += 1
            elif not getattr(_tls, "signals", True) and (op, *a[:1]) == poll:
                _tls.phase = AFTER  # a poll (_dcpc_wait): a wait-only launch's wait began
        return saved["create_atomic_rmw"](self, op, ptr, val, mask, *a)

    def cas(self: Any, ptr: Any, *a: Any) -> Any:
        if _active is not None:
            _active.record(_tls, "atomic", _masked(ptr, None))
        return saved["create_atomic_cas"](self, ptr, *a)

    def set_grid_idx(self: Any, x: int, y: int, z: int) -> Any:
        _tls.phase = _tls.launch_phase  # a new program starts before its signal
        return saved["set_grid_idx"](self, x, y, z)

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        # PUSH=False: the merge launch of a fused exchange, after the push launch's wait;
        # _<step>_merge: all_reduce (reduce: lse)'s merge launch, likewise
        merge = getattr(getattr(self, "fn", None), "__name__", "").endswith("_merge")
        _tls.launch_phase = AFTER if kwargs.get("PUSH", True) is False or merge else BEFORE
        # a kernel that signals (calls _dcpc_release) is after its wait from its signal only
        code = getattr(getattr(self, "fn", None), "__code__", None)
        _tls.signals = code is None or "_dcpc_release" in code.co_names
        grid = self.grid if not callable(self.grid) else (0,)
        if _active is not None and _tls.call is not None and _tls.trace is _active:
            with _active.lock:
                _tls.call.launches += 1
                step = _tls.call.step
                _active.programs[step] = max(_active.programs.get(step, 0), int(grid[0]))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _tls.launch_phase, _tls.signals = BEFORE, True

    def traced_bind(self: Any, slot: int, method: str, tensors: tuple, sizes: Any,
                    *rest: Any) -> Any:
        env = bind(self, slot, method, tensors, sizes, *rest)
        if _active is not None:
            _active.add_module(self)
            call = Call(self.rank, method, slot, dict(env))
            names = [p[0] for p in self._signatures[method].params]
            for name, t in zip(names, tensors, strict=True):
                span = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
                end = t.data_ptr() + (span + 1) * t.element_size() if t.numel() else t.data_ptr()
                call.engine.append((t.data_ptr(), end, name, t.element_size()))
            with _active.lock:
                _active.calls.append(call)
                _tls.call_id = len(_active.calls) - 1
            _tls.call, _tls.trace = call, _active
        return env

    with _install_lock:
        if _active is not None:
            raise RuntimeError("tracing() is already active")
        for name, fn in (("create_masked_load", load), ("create_masked_store", store),
                         ("create_atomic_rmw", rmw), ("create_atomic_cas", cas),
                         ("set_grid_idx", set_grid_idx)):
            setattr(builder, name, fn)
        interpreter.GridExecutor.__call__ = launch
        ScheduleModule._bind = traced_bind
        ScheduleModule._record = checked_only
        _active = trace
    try:
        yield trace
    finally:
        with _install_lock:
            for name, fn in saved.items():
                setattr(builder, name, fn)
            interpreter.GridExecutor.__call__ = grid_call
            ScheduleModule._bind = bind
            ScheduleModule._record = record
            _active = None
        trace.modules.clear()  # each rank's module and heap: not for the TracedRun's life


def _bank_words(module: Any, step: StepPlan, slot: int, world: int) -> str:
    """``module``'s signal bank for ``step`` in ``slot``: its programs' epochs, on the
    step's own channel (the kernel advances them there, templates/sync.j2), and the epoch
    in each peer's words on the channel it polls (a split wait polls its put's channel,
    ``sync.polls``; dcpc.runtime.sync: the low 32 bits)."""
    from dcpc.runtime.sync import channel, wrap_int32

    bank = getattr(module, "_bank", None)
    if bank is None or not hasattr(bank, "sig"):
        return "no signal bank (torch backend)"
    polled = step.index if step.sync.polls is None else step.sync.polls
    own, chan = channel(step.index, slot, module.SLOTS), channel(polled, slot, module.SLOTS)
    for c in (own, chan):
        if not 0 <= c < bank.channels:
            return f"channel {c} is not in its bank"
    mine = [int(e) for e in bank.epochs[own].tolist()]
    words = bank.sig[chan].tolist()
    theirs = ", ".join(f"rank {p} {[wrap_int32(int(w) & 0xFFFFFFFF) for w in words[p]]}"
                       for p in range(world) if p != module.rank)
    return (f"signal bank, slot {slot}: its programs' epochs on channel {own} (step "
            f"{step.index}) {mine}; the epochs in the words each peer signalled on channel "
            f"{chan} (step {polled}): {theirs}")


# ---- the comparison with the plan ---------------------------------------------------------
def _part_ok(region: Any, offs: np.ndarray, shape: tuple[int, ...], writer: int,
             world: int) -> np.ndarray:
    """Which elements (flat offsets of a buffer of ``shape``) lie in ``writer``'s part."""
    dim = region.dim
    inner = int(np.prod(shape[dim + 1:], dtype=np.int64))
    idx = (offs // max(inner, 1)) % max(shape[dim], 1)
    if region.scheme == "index":
        return idx == writer
    if region.scheme == "block":
        return idx // max(shape[dim] // world, 1) == writer
    if region.scheme == "root":  # broadcast: the root's store covers all; no other rank's
        return np.full(offs.shape, writer == region.dim)
    return (idx // region.interleave) % world == writer


def _team_part_ok(region: Any, offs: np.ndarray, shape: tuple[int, ...], writer: int,
                  owner: int, world: int) -> bool:
    """Whether ``writer``'s store into ``owner``'s instance lies in its part: over a team
    (``region.axes``) the owner is a member of the writer's team and the part is the
    writer's member index of G parts."""
    if region.axes is None:
        return bool(_part_ok(region, offs, shape, writer, world).all())
    team = torus(shape_of(world)).team(writer, region.axes)
    return owner in team and bool(
        _part_ok(region, offs, shape, team.index(writer), len(team)).all())


def _remote_read(where: str, buffer: str, owner: int, reader: int, world: int,
                 regions: list[Any], offs: np.ndarray, shape: tuple[int, ...]) -> list[str]:
    """What is wrong with ``reader``'s read of rank ``owner``'s instance: the plan allows
    it only by a region effect (pull's ``whole``), whose team must hold the owner, and
    within the buffer's shape."""
    regions = [r for r in regions if r is not None]
    if not regions:
        return [f"{where}: reads rank {owner}'s instance of '{buffer}'"]
    out = []
    if not any(r.axes is None or owner in torus(shape_of(world)).team(reader, r.axes)
               for r in regions):
        out.append(f"{where}: reads rank {owner}'s instance of '{buffer}', which is not "
                   "in its team")
    if (offs >= int(np.prod(shape, dtype=np.int64))).any():
        out.append(f"{where}: reads '{buffer}' of rank {owner} past its shape {shape}")
    return out


def check(trace: Trace, plan: Plan, world: int) -> list[str]:
    """What the kernels did that the plan's effects do not say, and what the effects say
    that no kernel did (see the module doc). Empty: they agree."""
    from dcpc.runtime import shapes

    steps: dict[str, StepPlan] = {s.name: s for s in plan.steps}
    kinds = {b.name: b.kind for b in plan.buffers}
    topo = torus(shape_of(world))
    problems: list[str] = []
    seen: set[tuple[str, str, str, str]] = set()
    for (cid, phase, access, buffer, owner, slot), offs in sorted(
            trace.accesses().items(), key=lambda kv: repr(kv[0])):
        call = trace.calls[cid]
        step = steps[call.step]
        where = f"step '{step.name}' (rank {call.rank}, slot {call.slot}, call {cid})"
        if buffer == OUTSIDE:
            addrs = ", ".join(hex(int(a)) for a in offs[:3])
            problems.append(f"{where}: {access} outside every buffer ({addrs}...)")
            continue
        for kind in (("read", "write") if access == "atomic" else (access,)):
            seen.add((step.name, buffer, kind, phase))
            said = [e for e in step.effects if e.buffer == buffer and e.kind == kind]
            match = [e for e in said if e.when == phase]
            if not match:
                table = ", ".join(f"{e.kind} {e.when}" for e in said) or "nothing"
                problems.append(f"{where}: {kind}s '{buffer}' {phase} its signal/wait; the "
                                f"plan says: {table}")
                continue
            if kinds.get(buffer) == "symmetric" and slot not in (-1, call.slot):
                problems.append(f"{where}: {kind}s '{buffer}' of slot {slot}")
            if kind == "read" and owner != call.rank:
                problems.extend(_remote_read(where, buffer, owner, call.rank, world,
                                             [e.region for e in match], offs,
                                             shapes.shape(plan.buffer(buffer).shape, call.env)))
            if kind != "write":
                continue
            regions = [e.region for e in match if e.region is not None]
            if not regions:
                if owner != call.rank:
                    problems.append(f"{where}: writes rank {owner}'s instance of '{buffer}', "
                                    "but its effect has no region (own instance only)")
                continue
            shape = shapes.shape(plan.buffer(buffer).shape, call.env)
            size = int(np.prod(shape, dtype=np.int64))
            if (offs >= size).any():
                problems.append(f"{where}: writes '{buffer}' past its shape {shape}")
            # a line's or perm's store lands where Region.target says (the one rule)
            if not any(r.target(call.rank, topo) == owner if r.scheme in ("line", "perm")
                       else r.writers(owner, world) == [call.rank] if r.scheme == "peer"
                       else _team_part_ok(r, offs, shape, call.rank, owner, world) and (
                           r.peer is None or r.writers(owner, world) == [call.rank])
                       for r in regions):
                problems.append(f"{where}: writes '{buffer}' of rank {owner} outside rank "
                                f"{call.rank}'s part ({regions[0].scheme}, dim "
                                f"{regions[0].dim})")
    for step in plan.steps:
        if not any(c.step == step.name for c in trace.calls):
            continue
        for e in step.effects:
            phases = (BEFORE, AFTER) if e.either else (e.when,)
            if not any((step.name, e.buffer, e.kind, p) in seen for p in phases):
                when = "before or after" if e.either else e.when
                problems.append(f"step '{step.name}': the plan says it {e.kind}s '{e.buffer}' "
                                f"{when} its signal/wait; no kernel did, on any rank")
    return list(dict.fromkeys(problems))  # an ``either`` pair missing is said once


# ---- a traced run --------------------------------------------------------------------------
@dataclass
class TracedRun:
    plan: Plan
    trace: Trace
    mismatches: int  # outputs that differ from the float64 simulation
    problems: list[str]


def run_traced(schedule_path: str, world: int, *, programs: int, block: int | None = None,
               calls: int = 2, seed: int = 0, order: str = "sequential",
               timeout_s: float | None = None, fault: dict | None = None) -> TracedRun:
    """Compile ``schedule_path``, run ``calls`` calls of every step on ``world`` ranks as
    threads (backend ``local``, ``programs`` per kernel, ``block`` elements per tile when
    given), every output compared with the float64 simulation, every access traced and
    checked against the plan. ``timeout_s``: the modules' wait bound (their default when
    None); ``fault``: an ``adversary.Fault`` as a dict (a rank that pauses). A rank that
    fails or hangs raises ``LocalRankError`` with, per rank, its last call by the
    record: step, slot, launches begun, atomic exchanges (signals) made."""
    import re
    import tempfile
    import warnings
    from pathlib import Path

    from dcpc.harness.worker import run_rank
    from dcpc.pipeline import Options
    from dcpc.pipeline import run as compile_stages
    from dcpc.runtime.local import LocalGroup, LocalRankError

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # log(0) in numpy: masked
    c = compile_stages(Path(schedule_path), Options(worlds=[world]), until="emit")
    assert c.schedule is not None and c.module_text is not None and c.plan is not None
    # every kernel's programs and tile size, as the module's own tuning defaults: the
    # harness's ``programs=`` is raised to the local backend's cap (4) for signalling steps
    text = re.sub(r'"programs": \d+', f'"programs": {programs}', c.module_text)
    if block is not None:
        text = re.sub(r'"block": \d+', f'"block": {block}', text)
    with tempfile.TemporaryDirectory(prefix="dcpc-trace-") as tmp:
        module = Path(tmp) / f"{c.schedule.schedule}.py"
        module.write_text(text)
        group = LocalGroup(world, "cpu", timeout_s=300.0)
        args = dict(schedule_path=str(schedule_path), module_path=str(module),
                    backend="local", calls=calls, seed=seed, jitter_s=0.0, order=order,
                    programs=None, timeout_s=timeout_s, fault=fault)
        first: list[str] = []  # the record when the first rank failed, before peers move on
        lock = threading.Lock()

        def record() -> str:  # a report that fails must not replace the rank's error
            try:
                return trace.progress(world, c.plan)
            except Exception as exc:  # noqa: BLE001 - said in its place
                return f"record unavailable: {type(exc).__name__}: {exc}"

        def rank_body(rank: Any) -> Any:
            try:
                return run_rank(rank.rank, world, group=rank, **args)
            except BaseException:
                with lock:
                    if not first:
                        first.append(record())
                raise

        with tracing() as trace:
            try:
                reports = group.run(rank_body)
            except LocalRankError as exc:  # say where every rank got to, by the record
                at_first = (f"\nwhen the first rank failed (the tracer's record):\n{first[0]}"
                            if first else "")
                raise LocalRankError(f"{exc}{at_first}\nwhere each rank got to (the tracer's "
                                     f"record):\n{record()}") from None
    mismatches = sum(s.mismatches for r in reports for s in r.outputs.values())
    return TracedRun(c.plan, trace, mismatches, check(trace, c.plan, world))
