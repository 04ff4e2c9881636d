"""One rank of a harness run: drive a generated module and check every output.

Runs in a child started by ``dcpc.harness.launch`` (gloo group initialised). The
rank imports the generated module from a file, constructs it (poisoned symmetric
memory, small maxima), then executes the run's events: a module method per
communication step, the harness's synthetic function per external step, with
seeded delays around each. Every value a method returns, and every module-owned
buffer an external step reads, is compared at once with what the float64 simulation
of the same call holds at that point (a buffer written twice in a call is compared
with each write). A synthetic external step writes what the schedule says it writes,
module-owned (symmetric) buffers included, into the module's own memory.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dcpc.harness import adversary, synth
from dcpc.harness.launch import progress
from dcpc.harness.simulate import (
    BITS,
    TORCH_DTYPES,
    Buffers,
    alias_views,
    bounds_at,
    buffer_shape,
    float_bits,
    float_value,
    named_rows,
    persistent_start,
    seen_at,
    simulate_call,
    step_rounding,
    unsent_at,
)
from dcpc.lang import model as m
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file
from dcpc.ops import OPS
from dcpc.ops.external import External
from dcpc.runtime.local import sync_stream, to_host

CONSTRUCT = "(construct)"  # a Fault's step: before the module's construction (no step name)


TOLERANCE = {  # (atol, rtol) of a computed value, by dtype
    "bf16": (1e-2, 1e-2), "f16": (2e-3, 2e-3), "f32": (1e-5, 1e-5),
}  # a computed fp8 value (output_scale): within its interval (simulate.fp8_bounds)


@dataclass
class OutputStats:
    compared: int = 0
    # returned where the reference left it as it was (a shift without wrap, on a rank
    # with no source) and nothing earlier in the call wrote it: nothing to compare
    kept: int = 0
    mismatches: int = 0
    max_abs_err: float = 0.0
    first_mismatch: str = ""


@dataclass
class RankReport:
    rank: int
    calls: int
    outputs: dict[str, OutputStats] = field(default_factory=dict)
    module_s: float = 0.0  # time inside the module's methods
    wall_s: float = 0.0
    cpu_s: float = 0.0  # CPU time of this process (the machine may be shared)
    epochs: list[int] = field(default_factory=list)  # the signal bank's epochs at the end
    notes: list[str] = field(default_factory=list)
    replay: str = ""  # the held rank of a replay: how its hold ended (dcpc.harness.replay)


def load_module_class(path: str, schedule: str) -> type:
    from dcpc.runtime.loading import import_file, schedule_class

    return schedule_class(import_file(path, f"dcpc_generated_{schedule}"), schedule)


def _constructor_kwargs(cls: type, wanted: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls).parameters
    missing = [k for k, v in wanted.items() if v is not None and k not in params]
    if missing:
        raise TypeError(f"{cls.__name__}() takes no {', '.join(missing)}")
    return {k: v for k, v in wanted.items() if v is not None}


def method_arguments(cls: type, step: str) -> list[str]:
    """The buffers a generated method takes, in order (its METHODS entry or signature)."""
    table = getattr(cls, "METHODS", None)
    if isinstance(table, dict) and step in table:
        return list(table[step])
    params = inspect.signature(getattr(cls, step)).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]


def returned_names(schedule: m.Schedule, world: int) -> dict[str, list[str]]:
    """What each step's method returns, in order: the plan's ``StepPlan.returns`` (the
    op's lowering says it once; lowering again here is milliseconds)."""
    from dcpc.codegen.lower import lower  # the compiler's: only a rank's run needs it

    return {s.name: list(s.returns) for s in lower(schedule, [world]).steps}


class NoInterval(ValueError):
    """A computed fp8 value (kind "math": an output_scale's, or what a move carried from
    one or from a computed f32) that the float64 simulation holds no interval for
    (simulate.bounds_at): a persistent buffer read in the next call, a cast of a computed
    f32 into fp8. Compared exactly, a kernel's fp32 error could move its byte; compared
    loosely, a wrong rounding passes: ``dcpc run`` says so, naming the buffer."""

    def __init__(self, name: str, dtype: str, where: str):
        self.name = name
        super().__init__(
            f"{where}: '{name}' ({dtype}) holds a computed fp8 value that dcpc run keeps "
            "no interval for (a persistent buffer read in the next call, or a cast of a "
            "computed f32 into fp8), so it cannot compare it (exactly, a kernel's fp32 "
            "error could move its byte): please report it with the schedule")


def compare(
    name: str, kind: str, dtype: str, got: torch.Tensor, want: torch.Tensor, stats: OutputStats,
    where: str, *, unsent: torch.Tensor | None = None, bounds: torch.Tensor | None = None,
) -> None:
    """Count a mismatch unless ``got`` matches ``want``: data movement bit-exact, math
    within the dtype's tolerance; NaN and inf must sit exactly where the reference has them.
    ``unsent``: the elements no rank sent (``simulate.unsent_at``: a ragged exchange's
    rows past a count; the reference holds NaN there, or ``UNSENT_INT``, so that a
    reader of them mismatches downstream): those elements are not compared; every other
    one is, a NaN a rank sent included. ``bounds``: [lo, hi] of a computed fp8 value
    (``simulate.bounds_at``; kind "math" only): a finite element passes where lo <= got
    <= hi; a computed fp8 value without one is ``NoInterval``, never compared exactly.
    Integers are compared as int64, bit for bit (a float64 rounds them past 2**53)."""
    stats.compared += 1
    integer = not m.DType(dtype).is_float
    got = _reference_form(_host(got.detach()), dtype)
    if tuple(got.shape) != tuple(want.shape):
        stats.mismatches += 1
        stats.first_mismatch = stats.first_mismatch or (
            f"{where}: {name} has shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
        return
    if integer:
        _compare_ints(name, got, want, stats, where, unsent=unsent)
        return
    if kind != "move" and bounds is None and m.DType(dtype).is_fp8:
        raise NoInterval(name, dtype, where)
    if unsent is not None:
        got = torch.where(unsent, want, got)
    finite = torch.isfinite(want) & torch.isfinite(got)
    zero = torch.zeros((), dtype=torch.float64)
    err = (got - want).abs().where(finite, zero)
    max_err = float(err.max()) if err.numel() else 0.0
    stats.max_abs_err = max(stats.max_abs_err, max_err)
    atol, rtol = (0.0, 0.0) if kind == "move" else TOLERANCE.get(dtype, (0.0, 0.0))
    special_ok = (got == want) | (torch.isnan(got) & torch.isnan(want))
    close = err <= atol + rtol * want.abs().where(finite, zero)
    if bounds is not None and kind != "move":
        close = (bounds[0] <= got) & (got <= bounds[1])
    ok = torch.where(finite, close, special_ok)
    if kind == "move":  # a float's bits are its value (float64 holds each, a NaN's bits
        # too: simulate.float_value): compare the bits too (bf16/f16 as int16, f32 as
        # int32, fp8 as bytes), so that a NaN's payload or sign, or a -0, a move changed
        # mismatches (a comparison by value takes them for equal); the value comparison
        # stays, so a value the dtype cannot hold (inf in e4m3, 0.3) is not taken for the
        # bits it rounds to
        ok = ok & (float_bits(got, dtype) == float_bits(want, dtype))
    _count(stats, ok, where, name, got, want, float, f", max abs err {max_err:.3g}")


def compare_rows(
    name: str, kind: str, dtype: str, got: torch.Tensor, want: torch.Tensor, stats: OutputStats,
    where: str, index: torch.Tensor | None, *, unsent: torch.Tensor | None = None,
    bounds: torch.Tensor | None = None,
) -> None:
    """``compare`` of what an engine step reads: the whole buffer, or with ``index`` (rows
    by values, ``q[idx]``: the index's values) exactly the rows it names
    (``simulate.named_rows``), the step's view; the other rows are not the step's."""
    if index is not None:
        ix = named_rows(index)
        got, want = got[ix.to(got.device)], want[ix]
        unsent = None if unsent is None else unsent[ix]
        bounds = None if bounds is None else bounds[:, ix]
    compare(name, kind, dtype, got, want, stats, where, unsent=unsent, bounds=bounds)


def _reference_form(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """An engine's tensor of ``dtype`` as the reference holds it: float64 (a NaN with its
    bits, ``float_value``), int64 for integers."""
    if t.dtype == TORCH_DTYPES.get(dtype) and m.DType(dtype).is_float:
        return float_value(t.contiguous().view(BITS[t.element_size()]), dtype)
    return t.to(torch.float64 if m.DType(dtype).is_float else torch.int64)


def _compare_ints(name: str, got: torch.Tensor, want: torch.Tensor, stats: OutputStats,
                  where: str, *, unsent: torch.Tensor | None) -> None:
    """``compare`` of integers (int64 both): equal, or ``unsent`` (the reference holds
    ``UNSENT_INT`` there); the error reported in float64 (a report only)."""
    ok = got == want
    if unsent is not None:
        ok |= unsent
    off = (got.double() - want.double()).abs().where(~ok, 0.0)
    max_err = float(off.max()) if off.numel() else 0.0
    stats.max_abs_err = max(stats.max_abs_err, max_err)
    _count(stats, ok, where, name, got, want, int)


def _count(stats: OutputStats, ok: torch.Tensor, where: str, name: str, got: torch.Tensor,
           want: torch.Tensor, value: Any, more: str = "") -> None:
    """A compared output with elements off (``ok`` False) counts one mismatch; the first
    is described at its first element (``value``: float or int, how it is printed)."""
    if bool(ok.all()):
        return
    stats.mismatches += 1
    if not stats.first_mismatch:
        index = tuple(int(i) for i in torch.nonzero(~ok)[0])
        stats.first_mismatch = (
            f"{where}: {name}{list(index)} = {value(got[index])}, reference "
            f"{value(want[index])} ({int((~ok).sum())} elements off{more})")


def _to_engine(schedule: m.Schedule, name: str, value: torch.Tensor,
               device: torch.device | None = None) -> torch.Tensor:
    """``value`` as the engine holds ``name``: its dtype, contiguous, on ``device``."""
    dtype = schedule.buffers[name].dtype.value
    value = (float_bits(value, dtype).view(TORCH_DTYPES[dtype]) if m.DType(dtype).is_float
             else value.to(TORCH_DTYPES[dtype]).contiguous())
    if device is None or device.type == "cpu" or value.device == device:
        return value
    sync_stream(device)  # never a pageable copy behind a kernel that may spin (to_host)
    return value.to(device)


def _views(schedule: m.Schedule, env: dict[str, torch.Tensor], name: str,
           sizes: dict[str, int], world: Any, dev: torch.device) -> None:
    """The engine's tensor used whole and by slice is one memory (simulate.alias_views):
    a write of one side shows in the other (zeros where the whole was never written)."""
    def blank(whole: str) -> torch.Tensor:
        shape = buffer_shape(schedule, whole, {**sizes, "W": int(world)})
        return _to_engine(schedule, whole, torch.zeros(shape), dev)

    alias_views(schedule, env, name, blank)


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU; from a GPU only after this rank's stream is done (see to_host)."""
    return to_host(t) if t.device.type != "cpu" else t


CARRIED = ("math-f32", "math-fp8")  # the computed values a move's dst compares as computed


class ValueKinds:
    """How each value is compared, by the ops that made it: "move" (bit for bit) or
    "math" (its dtype's tolerance). An op's own output is "math" when it computes it,
    "move" when it moves bits. What a move carries is compared bit for bit too (the
    reference rounds where the kernel stores, issue 21 item 6: a bf16 sum gathered is
    the bits the sum stored), except a value computed into f32: there the kernel's fp32
    order and float64's differ by an ulp that no rounding hides, which the move carries
    along (a sum broadcast is still a sum), and a value computed into fp8 (an
    output_scale), which a move carries with its interval (simulate.bounds_at: the
    kernel's byte may be any in it). Decided per buffer: each dst of a move takes
    its own src's kind (``synth.carries``), so a moved block beside a computed one in
    one step is still compared bit for bit. An engine step reads an op's output as
    "math" when an op computed it. A ``persist: true`` buffer starts a call with the
    kind of the previous call's last write (zeros, a "move", at call 0): a sum kept
    for the next call and moved there is still a sum. Made once per rank's run, in
    program order; a call's table by the kinds its persistent buffers start with."""

    def __init__(self, schedule: m.Schedule, steps: list[m.Step]):
        self._schedule, self._steps = schedule, steps
        self._persist = sorted(n for n, b in schedule.buffers.items() if b.persist)
        self._tables: dict[tuple, tuple[list, list, dict[str, str]]] = {}
        self._starts: list[tuple] = [()]  # per call: its persistent buffers' kinds

    def _table(self, start: tuple) -> tuple[list, list, dict[str, str]]:
        """(before, after, end) of a call whose persistent buffers start as ``start``."""
        if start in self._tables:
            return self._tables[start]
        schedule = self._schedule
        # buffer -> "move" | "math" | "math-f32" | "math-fp8" (the last two: carried)
        held: dict[str, str] = dict(start)
        before: list[dict[str, str]] = []
        after: list[dict[str, str]] = []  # per step: each buffer it writes
        for step in self._steps:
            before.append(dict(held))
            reads, writes = synth.op_io(step.op)
            wrote: dict[str, str] = {}
            if not OPS[step.op.op].moves(step.op):
                for w in writes:
                    dtype = schedule.buffers[w].dtype
                    wrote[w] = ("math-f32" if dtype == m.DType.f32 else
                                "math-fp8" if dtype.is_fp8 else "math")
            elif step.kind == "external":
                wrote.update({w: "move" for w in writes})
            else:  # each dst takes its own src's kind; another write, any read's
                carried = next((held[r] for r in reads if held.get(r) in CARRIED), "move")
                wrote.update({w: carried for w in writes})
                for src, dst in synth.carries(step.op):
                    wrote[dst] = held[src] if held.get(src) in CARRIED else "move"
            held.update(wrote)
            after.append(wrote)
        self._tables[start] = (before, after, held)
        return self._tables[start]

    def _call(self, call: int) -> tuple[list, list, dict[str, str]]:
        while len(self._starts) <= call:  # the next call starts where this one ended
            end = self._table(self._starts[-1])[2]
            self._starts.append(tuple((n, end[n]) for n in self._persist if n in end))
        return self._table(self._starts[call])

    def before(self, call: int, index: int, name: str) -> str:
        """How the value ``name`` holds before step ``index`` of ``call`` is compared
        (an engine step's read, a replay's watch)."""
        return "move" if self._call(call)[0][index].get(name, "move") == "move" else "math"

    def written(self, call: int, index: int, name: str) -> str:
        """How what step ``index`` of ``call`` writes into ``name`` is compared."""
        return "move" if self._call(call)[1][index].get(name, "move") == "move" else "math"


def _written(module: Any, schedule: m.Schedule, kinds: ValueKinds, step: m.Step,
             call: int, rank: int, slot: int, sizes: dict[str, int], trace: Any,
             name: str | None, at: str) -> Callable[[], bool] | None:
    """A replay's watch (None without one): whether this rank's instance of ``name`` no
    longer holds what ``step`` should see by the call's reference (``at`` "before" the
    step; "after": what it returned): the race's other write landed, even one that
    landed before the hold began. None too when the call has not written ``name``
    before that point: then a change could be this call's own store as well, and only
    the other step's flag releases the hold."""
    index = step.index + (at == "after")
    want = None if name is None else seen_at(trace, index, rank, name)
    if name is None or want is None:
        return None
    unsent = unsent_at(trace, index, rank, name)
    bounds = bounds_at(trace, index, rank, name)
    kind = (kinds.before(call, index, name) if at == "before"
            else kinds.written(call, step.index, name))

    def differs() -> bool:
        stats = OutputStats()
        got = module_view(module, schedule, name, slot, sizes)
        compare(name, kind, schedule.buffers[name].dtype.value, got, want,
                stats, "", unsent=unsent, bounds=bounds)
        return stats.mismatches > 0

    return differs


def module_view(module: Any, schedule: m.Schedule, name: str, slot: int,
                sizes: dict[str, int]) -> torch.Tensor:
    """What an engine step reading module-owned ``name`` gets: the module's memory, or
    for a chunk of a slot (``b[s][:, i]``, which the module allocates none of) its view
    of the slot's (``Schedule.view``)."""
    whole = schedule.module_view_of(name)
    if whole is not None:
        return schedule.view(whole, module.buffer(whole, slot, sizes),
                             schedule.slice_of(name)[1])
    return module.buffer(name, slot, sizes)


def _module_owned(module: Any, name: str) -> bool:
    """The module allocates ``name`` (symmetric, or a persistent output it returns)."""
    table = getattr(module, "BUFFERS", {})
    return name in table and getattr(table[name], "kind", "engine") != "engine"


# How often a rank waiting for another's float64 simulation of a call looks at its lock:
# every waiting rank of every call of a host run starts up to this late after the
# simulation is saved (50 ms made 0.1 s of a 4-call run's wall time; a look is one
# non-blocking flock).
STORE_POLL_S = 0.005


class CallSims:
    """The float64 simulations of a run's calls, ``sims``: call -> (sizes, inputs,
    external, trace, end), every rank's at once (``simulate_call``), so that the ranks
    of one process (backend local: ``users`` threads) share one: made once per call, not
    once per rank (the ranks' host work was W times the simulation: deepep_normal at 2x4
    on one GPU, past its 150 s deadline). With a persistent buffer, calls are simulated
    in order (a call starts with what the call before left at its ``end``:
    simulate.persistent_start), so a call may be simulated before it starts (interleaved
    order can run all of call b before call b - 1). A call is dropped once every user
    finished it and no call needs it any more (the next call has its start, or nothing
    persists): the simulations kept are the calls in flight or ahead, and the last one's
    end (``most``: the most kept at once). ``keep`` (two passes over the same calls, the
    GPU warm-up): every call stays. Thread-safe: the first rank to ask for a call
    simulates it, the others wait for it (host work only: it always ends); ``get``'s
    ``say`` hears each step the simulation runs, so a simulation longer than the stall
    bound reads as progress (the launcher's, a LocalGroup's: any rank that moves), not
    as a hang. ``reference`` False (the capture of launches, dcpc.harness.ptx): a call's
    sizes, inputs and engine steps alone, the same as with it (made before the
    simulation, from the seed), no float64 simulation (its trace and end are None).
    ``store``: a folder the processes of one run (backend host, one per rank) share
    each call's simulation through (``_stored``): one process simulates it, not W;
    ``store_users`` (W) processes read each call, the last one deletes its file."""

    def __init__(self, schedule: m.Schedule, world: Any, ctor: dict[str, int], seed: int,
                 rounding: Any, *, users: int = 1, keep: bool = False,
                 reference: bool = True, store: str | None = None,
                 store_users: int = 1) -> None:
        self.schedule, self.world, self.ctor, self.seed = schedule, world, ctor, seed
        self.store = store  # a folder the run's processes share the simulations through
        self.store_users = store_users  # the processes that read each call from store
        self.rounding, self.users, self.keep = rounding, users, keep
        self.reference = reference
        self.sims: dict[int, Any] = {}
        self.persist = {n for n, b in schedule.buffers.items() if b.persist}
        self.finished: set[int] = set()  # calls every user finished
        self._done: dict[int, int] = {}  # call -> users that finished it
        self._lock = threading.Lock()
        self.most = 0

    def get(self, call: int, say: Callable[[str], None] | None = None) -> tuple:
        """The call's (sizes, inputs, external, trace), simulated after every call before
        it where a buffer persists; ``say``: told what the simulation is at (progress)."""
        with self._lock:
            while call not in self.sims:
                k = max(self.sims, default=-1) + 1 if self.persist else call
                if k > call or call in self.finished:  # dropped: it would never come back
                    raise RuntimeError(f"call {call}'s simulation was dropped before it ran")
                self._simulate(k, say)
            return self.sims[call][:4]

    def _simulate(self, k: int, say: Callable[[str], None] | None = None) -> None:
        schedule, world = self.schedule, self.world
        if say is not None:
            say(f"call {k}: the float64 reference's inputs")
        sizes = synth.call_sizes(schedule, world, self.ctor, self.seed, k)
        external = synth.make_external(schedule, world, sizes, self.seed, k)
        if not self.reference:  # the persistent buffers' start is the reference's
            inputs = synth.call_inputs(schedule, world, sizes, self.seed, k)
            self.sims[k] = (sizes, inputs, external, None, None)
            self.most = max(self.most, len(self.sims))
            self._drop()
            return

        def reference() -> tuple[list[Buffers], list[list[Buffers]], list[Buffers]]:
            # made here: a process that loads the call from store needs none of it
            inputs = synth.call_inputs(schedule, world, sizes, self.seed, k)
            if self.persist:
                for bufs, start in zip(inputs, persistent_start(
                        schedule, world, sizes, self.sims[k - 1][4] if k else None),
                        strict=True):
                    bufs.update(start)
            trace: list[list[Buffers]] = []  # per step: what it wrote, on every rank
            end = simulate_call(schedule, world, sizes, inputs, external, trace=trace,
                                rounding=self.rounding, progress=None if say is None else (
                                    lambda s: say(f"call {k}: the float64 reference of step "
                                                  f"{s.name}")))
            return inputs, trace, end

        inputs, trace, end = (reference() if self.store is None
                              else self._stored(k, reference, say))
        self.sims[k] = (sizes, inputs, external, trace, end)
        self.most = max(self.most, len(self.sims))
        self._drop()

    def _stored(self, k: int, reference: Callable[[], Any],
                say: Callable[[str], None] | None = None) -> Any:
        """Call ``k``'s (inputs, trace, end) shared through ``store`` by the processes of
        one run (backend host: a process per rank, each simulated every call whole, W
        times the host work): the first to take the call's lock simulates it and saves
        it (torch.save: every tensor's bits, its storage sharing); the others wait on the
        lock and load it. A process that dies while it simulates frees the lock and
        leaves no file (written aside, then renamed): the next one simulates. A waiter
        polls the lock and ``say``s how long it has waited (progress, not a hang). A
        simulation that raises leaves ``call{k}.err`` (the error pickled, else its text):
        the others raise it at once instead of simulating again. Each process counts
        itself in ``call{k}.n`` under the lock; the ``store_users``-th deletes the
        call's files (a run of many calls keeps only the calls in flight on disk)."""
        import fcntl
        import pickle

        assert self.store is not None
        path = os.path.join(self.store, f"call{k}.pt")
        with open(f"{path}.lock", "a") as lock:
            start = time.monotonic()
            told = 0
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(STORE_POLL_S)
                    waited = int(time.monotonic() - start)
                    if say is not None and waited > told:
                        told = waited
                        say(f"call {k}: waiting {waited} s for another rank's "
                            f"float64 reference")
            err = os.path.join(self.store, f"call{k}.err")
            if os.path.exists(err):
                with open(err, "rb") as f:
                    raise pickle.load(f)
            if os.path.exists(path):
                got = torch.load(path, weights_only=False)
            else:
                try:
                    got = reference()
                except Exception as e:
                    try:
                        blob = pickle.dumps(e)
                        pickle.loads(blob)
                    except Exception:  # not picklable: its type and text
                        blob = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
                    aside = f"{err}.{os.getpid()}"
                    with open(aside, "wb") as f:
                        f.write(blob)
                    os.replace(aside, err)
                    raise
                if self.store_users > 1:
                    aside = f"{path}.{os.getpid()}"
                    torch.save(got, aside)
                    os.replace(aside, path)
            count = os.path.join(self.store, f"call{k}.n")
            users = 1
            if os.path.exists(count):
                with open(count) as f:
                    users += int(f.read())
            if users >= self.store_users:  # the last reader: nobody needs the files
                for gone in (path, count, f"{path}.lock"):
                    if os.path.exists(gone):
                        os.remove(gone)
            else:
                with open(count, "w") as f:
                    f.write(str(users))
            return got

    def finish(self, call: int) -> None:
        """One user (a rank) ran the call's last step."""
        with self._lock:
            self._done[call] = self._done.get(call, 0) + 1
            if self._done[call] >= self.users:
                self.finished.add(call)
            self._drop()

    def _drop(self) -> None:
        if self.keep:
            return
        for k in [k for k in self.sims if k in self.finished
                  and (not self.persist or k + 1 in self.sims)]:
            del self.sims[k]


class SharedSims:
    """One ``CallSims`` for the ranks (threads) of one process, made by the first rank
    that asks (``run_rank`` knows the schedule, sizes and rounding: the same on every
    rank). ``keep``: every call stays (two passes, the GPU warm-up). ``reference``
    False: no float64 simulation (``CallSims``; the capture of launches)."""

    def __init__(self, users: int, keep: bool = False, reference: bool = True) -> None:
        self.users, self.keep, self.reference = users, keep, reference
        self._lock = threading.Lock()
        self._sims: CallSims | None = None

    def bind(self, *args: Any) -> CallSims:
        """The shared ``CallSims(*args)``; made at the first call."""
        with self._lock:
            if self._sims is None:
                self._sims = CallSims(*args, users=self.users, keep=self.keep,
                                      reference=self.reference)
            return self._sims


def run_rank(
    rank: int,
    world: int,
    *,
    schedule_path: str,
    module_path: str,
    backend: str | dict[str, str],
    calls: int,
    seed: int = 0,
    jitter_s: float = 0.002,
    jitter_p: float = 0.3,
    poison: bool = True,
    order: str = "sequential",
    timeout_s: float | None = None,
    epoch_start: int | None = None,
    fault: dict[str, Any] | None = None,
    programs: int | None = None,
    group: Any = None,
    mesh: list[int] | None = None,
    sizes: dict[str, int] | None = None,
    device: str = "cpu",
    sims: SharedSims | None = None,
    program_order: str = "natural",
    handshake: bool = True,
    replay: dict[str, Any] | None = None,
    check: bool = True,
    reference: bool = True,
    sims_dir: str | None = None,
    sims_users: int = 1,
) -> RankReport:
    """One rank's calls, each output compared with the float64 simulation. ``group``: a
    ``dcpc.runtime.local.LocalRank`` (backend local, ranks as threads), else the gloo
    group of this process. ``mesh``: the mesh shape of a schedule with ``mesh:``.
    ``device``: where the module, its inputs and the engine steps' values live (the
    float64 simulation stays on the CPU); on a GPU every kernel's error record is read
    after each call, so a failed wait is named at the call that made it. ``sims``: the
    float64 simulations shared by the ranks of this process (backend local), and between
    two passes over the same calls (the GPU warm-up). ``program_order``: the order in
    which the CPU interpreter takes the programs of a launch (dcpc.harness.interpret).
    ``handshake``: the module's torch handshake (False: its torch steps pair only through
    their collectives). ``replay``: hold one step back until a race's other access
    happened (dcpc.harness.replay). ``check``: compare each value with the reference
    (False: a pass whose report nobody reads, the GPU warm-up's, skips that host work).
    ``sims_dir``: a folder of the run the ranks' processes share each call's float64
    simulation through (CallSims ``store``; one process per rank; ``sims_users``: the
    processes, each call's file deleted once all read it). ``reference`` False:
    no float64 simulation at all, nothing compared (``check`` must
    be False too; ``sims``, if given, made with ``reference=False``): the capture of
    what a run launches (dcpc.harness.ptx), which reads no comparison. The module, its
    inputs, its engine steps' values and so its launches are the run's own: the
    simulation only reads them (CallSims makes the inputs before it), and an engine
    step's values are made from what the rank's own buffers hold."""
    if not reference and (check or replay is not None):
        raise ValueError("run_rank: reference=False compares nothing: check=False, no replay")
    start, cpu_start = time.perf_counter(), time.process_time()
    if device == "cpu":  # Triton's interpreter patches triton.language once per process,
        # not around every launch and device-function call (the local backend's shim):
        # a quarter to a third of a rank's CPU time under the interpreter
        from dcpc.runtime.local import _install_interpreter_threads

        _install_interpreter_threads()
        if group is None and sims_dir is not None:  # ranks as processes, one module:
            # each rewrite made once a run, kept in the run's own folder (never beside a
            # user's --module file)
            from dcpc.harness.interpret import share_rewrites

            share_rewrites(module_path, os.path.join(sims_dir, "rewrites"))
    if mesh:
        world = MeshWorld(mesh)
    # -inf LSEs of empty shards make numpy warn inside the interpreter: expected, not news
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    if device == "cpu" and program_order != "natural":
        from dcpc.harness.interpret import program_order as order_programs

        order_programs(program_order, seed)
    schedule = parse_file(schedule_path, world=world)
    steps = schedule.step_list()
    kinds = ValueKinds(schedule, steps)
    cls = load_module_class(module_path, schedule.schedule)
    served = cls.for_world(world)  # a module of several W: the class of this W (its tables)
    ctor = synth.constructor_sizes(schedule, world, sizes)
    rounding = step_rounding(schedule, backend, device)  # how stores round into bf16
    # ``programs`` for every step (signalling or not): the interpreter runs programs
    # one after another, so fewer programs is the cheap way to run on CPU
    tuning = None if programs is None else {
        step: {"programs": programs} for step in getattr(served, "TUNING", {})}
    kwargs = _constructor_kwargs(
        served, {"timeout_s": timeout_s, "epoch_start": epoch_start, "poison": poison,
              "tuning": tuning, "handshake": None if handshake else False})
    strike = adversary.Fault(**fault) if fault else None
    def say(text: str) -> None:  # the launcher's record; a LocalRank's, for its group
        progress(text)
        if hasattr(group, "progress"):
            group.progress(text)

    say("construction")
    if strike is not None:  # step CONSTRUCT: the rank stops before it constructs
        strike.strike(rank, 0, CONSTRUCT)
    dev = torch.device(device)
    module = cls(dist.group.WORLD if group is None else group, sizes=ctor, device=dev,
                 backend=backend, **kwargs)
    jitter = adversary.Jitter(seed, rank, jitter_s, jitter_p)
    report = RankReport(rank, calls)
    returns = returned_names(schedule, world)
    for step in steps:
        for name in returns[step.name]:
            report.outputs.setdefault(name, OutputStats())
    returned = set(report.outputs)

    # call -> (trace, the engine's tensors, external, sizes, this rank's inputs)
    live: dict[int, tuple[list[list[Buffers]], dict[str, torch.Tensor], Any, Any, Buffers]] = {}
    lead = None  # a replay of two calls in flight: the other access's step runs first
    if replay is not None and replay["hold"][1] != replay["release"][1]:
        at = {s.name: k for k, s in enumerate(steps)}
        held_step = (replay["hold"][1], at[replay["hold"][2]])
        other = (replay["release"][1], at[replay["release"][2]])
        # held before its step: the other access's step first; held after its return:
        # the held step first, then the other one writes into what it returned
        lead = (held_step, other) if replay["at"] == "before" else (other, held_step)
    calls_sim = (CallSims(schedule, world, ctor, seed, rounding, reference=reference,
                          store=sims_dir, store_users=sims_users)
                 if sims is None else sims.bind(schedule, world, ctor, seed, rounding))
    if calls_sim.reference != reference:
        raise ValueError("run_rank: sims made with another reference= than the run's")
    persist = calls_sim.persist

    def held(call: int, index: int, name: str) -> torch.Tensor | None:
        """What ``name`` holds on this rank before step ``index`` of ``call``: the call's
        last write, else a persistent buffer's value at the call's start."""
        want = seen_at(live[call][0], index, rank, name)
        return live[call][4][name] if want is None and name in persist else want

    for event in adversary.plan_events(schedule, calls, order, seed, lead):
        if event.call not in live:
            sizes, inputs, external, trace = calls_sim.get(event.call, say)
            # a persistent buffer is the module's, not the engine's: kept apart (start)
            env = {k: _to_engine(schedule, k, v, dev) for k, v in inputs[rank].items()
                   if k not in persist}
            live[event.call] = (trace, env, external, sizes, inputs[rank])
        trace, env, external, sizes, _ = live[event.call]
        step = steps[event.step]
        kind = "engine step" if isinstance(step.op, External) else "method"
        say(f"call {event.call} (slot {event.slot}): {kind} {step.name}()")
        if strike is not None:
            strike.strike(rank, event.call, step.name)
        jitter.delay()
        here = [rank, event.call, step.name]
        # a replay's hold of this step: "before" it, or "after" its return (the engine's
        # read of what it returned), before the run compares what it returned
        hold_at = replay["at"] if replay is not None and here == replay["hold"] else None
        if hold_at is not None:
            holding = (f"call {event.call} (slot {event.slot}): {step.name}() held "
                       f"{'before it' if hold_at == 'before' else 'after its return'} (replay)")
            watch = _written(module, schedule, kinds, step, event.call, rank, event.slot,
                             sizes, trace, replay["watch"], hold_at)
        if hold_at == "before":
            say(holding)
            report.replay = adversary.replay_hold(replay, watch)
        if isinstance(step.op, External) and not module.runs(step.name):
            pass  # a guarded engine step whose when: fails on this rank (module.runs)
        elif isinstance(step.op, External):
            for name in step.op.reads:  # module-owned buffers an engine step reads: check them
                if name in env and not schedule.buffers[name].is_symmetric:
                    continue  # the engine's own tensor
                got = module_view(module, schedule, name, event.slot, sizes)
                want = held(event.call, step.index, name) if reference else None
                if want is not None and check:  # what the call wrote before this step
                    where = f"call {event.call} slot {event.slot} rank {rank} ({step.name} reads)"
                    # a method's output read again by the engine: counted on its own
                    key = f"{name}@{step.name}" if name in returned else name
                    unsent = unsent_at(trace, step.index, rank, name)
                    bounds = bounds_at(trace, step.index, rank, name)
                    index = step.op.rows.get(name)
                    if index is not None:  # rows by values: the rows the step reads
                        where += f" rows {index}"
                    compare_rows(name, kinds.before(event.call, step.index, name),
                                 schedule.buffers[name].dtype.value, got, want,
                                 report.outputs.setdefault(key, OutputStats()), where,
                                 None if index is None else _host(env[index]),
                                 unsent=unsent, bounds=bounds)
                env[name] = got
            seen = {k: _host(v).to(torch.float64) if k not in schedule.buffers else
                    _reference_form(_host(v), schedule.buffers[k].dtype.value).double()
                    for k, v in env.items()}
            for name, value in external(step, rank, seen).items():
                value = _to_engine(schedule, name, value, dev)
                if _module_owned(module, name) or schedule.module_view_of(name):
                    # into the module's memory (a chunk: its view), as an engine would
                    target = module_view(module, schedule, name, event.slot, sizes)
                    target.copy_(value)
                    value = target
                env[name] = value
                _views(schedule, env, name, sizes, world, dev)
        else:
            # a guarded method whose when: fails here still gets its arguments; what
            # the rank's engine never made (a skipped engine step's output) is zeros
            args = [env[name] if name in env else _to_engine(schedule, name, torch.zeros(
                buffer_shape(schedule, name, {**sizes, "W": int(world)})), dev)
                for name in method_arguments(served, step.name)]
            method = getattr(module, step.name)
            bind = {}  # the call's run-time sizes, for methods no argument binds them from
            if "sizes" in inspect.signature(method).parameters:
                bind = {"sizes": {k: sizes[k] for k in synth.runtime_sizes(schedule)}}
            t0 = time.perf_counter()
            result = method(*args, slot=event.slot, **bind)
            report.module_s += time.perf_counter() - t0
            if dev.type == "cuda":  # the kernels' error record (a sync): named at its call
                module.check_errors()
            values = [] if result is None else list(result) if isinstance(
                result, (tuple, list)) else [result]
            if hold_at == "after":  # the engine reads what it returned: a peer writes first
                say(holding)
                report.replay = adversary.replay_hold(replay, watch)
            names = returns[step.name]
            if len(values) != len(names):
                raise TypeError(f"{step.name}() returned {len(values)} tensors, want {names}")
            for name, value in zip(names, values, strict=True):
                env[name] = value
                _views(schedule, env, name, sizes, world, dev)
                if not reference:
                    continue
                # a step may leave a returned buffer as it was on some ranks (a shift
                # without wrap: the first ranks receive nothing): what it held before,
                # and nothing to compare when no step of the call wrote it there
                want = trace[step.index][rank].get(name)
                if want is None:
                    want = held(event.call, step.index, name)
                if want is None:
                    report.outputs.setdefault(name, OutputStats()).kept += 1
                    continue
                if check:
                    compare(name, kinds.written(event.call, step.index, name),
                            schedule.buffers[name].dtype.value, value,
                            want, report.outputs[name],
                            f"call {event.call} slot {event.slot} rank {rank} ({step.name})",
                            unsent=unsent_at(trace, step.index + 1, rank, name),
                            bounds=bounds_at(trace, step.index + 1, rank, name))
        if replay is not None and here == replay["release"]:
            adversary.replay_release(replay)
        jitter.delay()
        if event.step == len(steps) - 1:
            del live[event.call]
            calls_sim.finish(event.call)
    bank = getattr(module, "_bank", None)
    if bank is not None and hasattr(bank, "epochs"):
        report.epochs = sorted(set(bank.epochs.flatten().tolist()))
    if group is None:  # nobody closes its heap while a peer may still store into it
        dist.barrier()
    else:
        group.barrier()
    module.close()
    report.wall_s = time.perf_counter() - start
    report.cpu_s = time.process_time() - cpu_start
    return report


def run_local(process: int, processes: int, *, ranks: int, device: str = "cpu",
              **args: Any) -> list[RankReport]:
    """Backend ``local``: all ``ranks`` as threads of this one process (a LocalGroup on
    ``device``), each running ``run_rank``; their reports, by rank.

    On a GPU the ranks share one CUDA context, and a kernel compiled or loaded while a
    peer's kernel spins can hang the device: each rank first makes every call of the run
    inside ``compile_only`` (every kernel of every size variant compiled and loaded,
    nothing launched; the module files are imported once per process), then every rank
    meets, then the run proper starts. A failed wait records its error instead of
    trapping (DCPC_TRAP=0): a trap would end every rank of the process and the record."""
    from dcpc.runtime.local import LocalGroup, compile_only

    del process, processes  # one process, launched alone
    group = LocalGroup(ranks, device, timeout_s=float(args.pop("group_timeout_s", 600.0)))
    stall = args.pop("group_stall_s", None)  # a hang: no rank said anything new that long
    if group.device.type == "cpu":  # the ranks share the float64 simulation of each call
        sims = SharedSims(ranks)
        return group.run(lambda rank: run_rank(rank.rank, ranks, group=rank, sims=sims,
                                               **args), stall_s=stall)
    os.environ["DCPC_TRAP"] = "0"
    sims = SharedSims(ranks, keep=True)  # every rank's, both passes

    def body(rank: Any) -> RankReport:
        with compile_only():  # its report is not read: no comparison
            run_rank(rank.rank, ranks, group=rank, device=str(group.device),
                     sims=sims, check=False, **args)
        rank.barrier()
        return run_rank(rank.rank, ranks, group=rank, device=str(group.device),
                        sims=sims, **args)

    return group.run(body, stall_s=stall)


def run_gpus(rank: int, world: int, **args: Any) -> RankReport:
    """One rank per GPU (W processes, W GPUs): this process's rank on GPU ``rank`` with
    torch symmetric memory (backend symm_mem), or the given per-axis backends."""
    torch.cuda.set_device(rank)
    return run_rank(rank, world, device=f"cuda:{rank}", **args)
