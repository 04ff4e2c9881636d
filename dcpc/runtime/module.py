"""``ScheduleModule``: the construction and call machinery every generated class shares.

A generated class (one per schedule) sets the class constants below and adds one
method per non-external step plus its Triton kernels. This base class binds the
construction-time sizes, allocates every symmetric buffer of every slot with ONE
``heap.allocate`` call, the signal bank and the module-owned outputs, and gives the
methods cheap helpers: ``_bind`` (run-time sizes from argument shapes, validated),
``_scalars``, ``_view`` and ``_check``. Nothing here allocates after construction.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dcpc.runtime import axes, calls, rendezvous, shapes, sync, tiles, validate
from dcpc.runtime import guard as _guard
from dcpc.runtime.backend import group_rank_world, make_heap, resolve_backend
from dcpc.runtime.clock import kernel_clock
from dcpc.runtime.errors import DcpcArgumentError, DcpcFailedError
from dcpc.runtime.heap import poison_
from dcpc.runtime.local import sync_stream
from dcpc.runtime.teams import TeamsMixin
from dcpc.runtime.teams import torus as _teams_torus
from dcpc.runtime.validate import DTYPES, Signature, check_sizes
from dcpc.topology import ROTATION, rotations

# Bounded waits, in seconds, on every backend: a wait for a peer that lasts longer
# records a timeout (step, peer, epoch). Ranks legitimately drift by seconds (a peer
# JIT-compiling a kernel, a descheduled host thread, the interpreter on a loaded CPU),
# so the default is a minute. GPU: measured by the global timer inside the kernel;
# CPU: a watchdog thread stops the interpreter's spin (dcpc.runtime.sync.Watchdog).
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 10**7  # ~4 months: keeps timeout_ns far inside int64
CPU_PROGRAMS = 4  # default cap on programs per launch on CPU (host backend)
MIN_BLOCK = 1024  # elements: small calls split their tiles down to this (see _launch)
FP8_VECTOR = 4  # elements a thread of a tile that stores fp8 into a peer (_fp8_tile)
WARP_THREADS = 32
MAX_BYTES = 2**46  # a rank's buffers above this (64 TiB) are refused at construction
# A call's ``call_id`` enters its fingerprint modulo CALL_IDS, as the last digit of the
# mixed-radix number (a pseudo-size that no schedule can name): ranks whose calls pair
# with calls of another id (a rank skipped or repeated one) raise on that call.
CALL_ID = "call_id (mod 256)"
CALL_IDS = 256


@dataclass(frozen=True)
class Buf:
    """A buffer of the schedule: shape ASTs, dtype name, and who owns it."""

    shape: tuple
    dtype: str
    kind: str  # engine | symmetric | shared | output
    persist: bool = False  # one instance for all slots, zeros at construction, never reset


@dataclass
class Tune:
    """Launch parameters of one step, decided at construction (the GPU tuning knobs)."""

    programs: int  # the most programs a launch uses (the signal bank's width)
    num_warps: int
    block: int
    tiles: list[tuple[int, int]] = field(default_factory=list)  # (BLOCK_R, BLOCK_C) per space
    statics: dict[str, int] = field(default_factory=dict)
    tiles_per_program: int = 1  # below `programs`, a launch has one program per this many tiles
    fixed: list[int] = field(default_factory=list)  # per space: its length if fixed, else 0


class ScheduleModule(TeamsMixin, calls.CallPlans):
    _call_ids: ClassVar[int] = CALL_IDS  # type: ignore[misc]
    SCHEDULE: ClassVar[str] = ""
    SOURCE_SHA256: ClassVar[str] = ""
    SLOTS: ClassVar[int] = 1
    # unrolled for this W only (a loop names W), or this mesh shape only (one names an
    # axis' size: a tuple, outermost axis first)
    LOOP_WORLD: ClassVar[int | tuple[int, ...] | None] = None
    # one module for several W (`dcpc compile --world 2..4` of a file whose loops name W):
    # W -> the class unrolled for it (set on a ModuleOfWorlds)
    LOOP_WORLDS: ClassVar[Mapping[int, type[ScheduleModule]]] = {}
    STEPS: ClassVar[tuple[str, ...]] = ()
    SIZES: ClassVar[dict[str, tuple]] = {}  # name -> ("const", n) | ("max", n) | ("multiple_of", e)
    BUFFERS: ClassVar[dict[str, Buf]] = {}
    METHODS: ClassVar[dict[str, tuple[str, ...]]] = {}  # method -> argument buffers
    SCALARS: ClassVar[dict[str, tuple[tuple[str, tuple], ...]]] = {}  # per call, in order
    LAYOUTS: ClassVar[dict[str, tuple[tuple[str, int, int, bool], ...]]] = {}  # strided inputs
    STATICS: ClassVar[dict[str, dict[str, tuple]]] = {}  # evaluated at the maxima
    TILES: ClassVar[dict[str, tuple[tuple, ...]]] = {}  # row-length ASTs of tile spaces
    SCRATCH: ClassVar[dict[str, dict[str, tuple[tuple, str]]]] = {}  # torch backend only
    TUNING: ClassVar[dict[str, dict[str, int]]] = {}
    SIGNALLING: ClassVar[tuple[str, ...]] = ()  # steps whose kernels use signal slots
    # step -> its ``when:`` condition (a dcpc.exprs AST): it runs where that holds
    WHEN: ClassVar[dict[str, tuple]] = {}
    # a split wait -> its put (written before it): the wait launches the put's grid from
    # its own sizes, so it must repeat the put's (_split_sizes)
    PUTS: ClassVar[dict[str, str]] = {}

    def runs(self, step: str, rank: int | None = None) -> bool:
        """Whether step ``step`` runs on this rank (or on ``rank``): False where its
        ``when:`` fails (a guarded method then returns without launching; an engine
        skips a guarded engine step). The rank is fixed per process, so the answer is
        the same on every call and a CUDA graph captured on a rank stays right for it."""
        cond = self.WHEN.get(step)
        if cond is None:
            return True
        rank = self.rank if rank is None else rank
        env = {k: v[1] for k, v in self.SIZES.items() if v[0] == "const"}
        env.update(rank=rank, W=self.world)
        shape = getattr(self, "mesh_shape", None)
        if self.MESH and shape is not None:  # each axis' coordinate, each size name's size
            coords = _teams_torus(tuple(shape)).coords(rank)
            env.update({a: c for (a, _), c in zip(self.MESH, coords, strict=True)})
            env.update({s: n for (_, s), n in zip(self.MESH, shape, strict=True)
                        if isinstance(s, str)})
        return shapes.holds(cond, env)

    @classmethod
    def for_world(cls, world: int) -> type[ScheduleModule]:
        """The class that serves a group of ``world`` ranks: the variant unrolled for it
        in a module of several W (``LOOP_WORLDS``), else this class (whose constructor
        checks ``LOOP_WORLD``)."""
        if not cls.LOOP_WORLDS:
            return cls
        variant = cls.LOOP_WORLDS.get(int(world))
        if variant is None:
            served = sorted(cls.LOOP_WORLDS)
            raise ValueError(
                f"{cls.__name__}: this module's loops were unrolled for each W in "
                f"{', '.join(map(str, served))} (a trip count names W), but the group has "
                f"{int(world)} ranks; compile it with --world {int(world)} (or a list of W "
                f"that holds it)")
        return variant

    def __init__(
        self,
        group: Any = None,
        sizes: Mapping[str, int] | None = None,
        device: str | torch.device | None = None,
        backend: str | Mapping[str, str] = "auto",
        *,
        groups: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        guard: bool = True,
        handshake: bool = True,
        epoch_start: int = 0,
        poison: bool = False,
        programs: int | None = None,
        tuning: Mapping[str, Mapping[str, int]] | None = None,
    ):
        name = type(self).__name__
        self._busy = threading.Lock()  # one call at a time (dcpc.runtime.guard.guarded)
        self._caller: tuple[str, dict, int] | None = None  # the call in it (guarded)
        self._refused: BaseException | None = None  # a call refused while one ran
        self._failed: BaseException | None = None  # the first error of a call (see _fail)
        self._notified = False  # peers were told this instance failed (see _fail)
        self._heap = None
        self.group = group
        self.rank, self.world = group_rank_world(group)
        if isinstance(self.LOOP_WORLD, int) and self.world != self.LOOP_WORLD:
            raise ValueError(
                f"{name}: this module's loops were unrolled for W={self.LOOP_WORLD} (a trip "
                f"count names W), but the group has {self.world} ranks; compile it with "
                f"--world {self.world}")
        kind, self.backends, torch_teams = axes.split(
            name, backend, self.MESH, self.TEAMS, self.SIGNALLING)
        self.device = validate.check_device(name, device, kind)
        self.backend = resolve_backend(kind, group, self.device)
        # the steps that run their torch body: every step on torch; on a mesh whose axes
        # run on different kinds, the steps whose axes are all on torch (runtime/axes.py)
        self._on_torch = frozenset(self.STEPS if self.backend == "torch" else torch_teams)
        self._torch_teams = torch_teams
        self._mixed = bool(torch_teams) and self.backend != "torch"
        if timeout_s is None:
            timeout_s = DEFAULT_TIMEOUT_S
        validate.check_number(name, "timeout_s (seconds)", timeout_s, 1e-3, MAX_TIMEOUT_S, float)
        for flag, value in (("guard", guard), ("handshake", handshake), ("poison", poison)):
            if not isinstance(value, bool):
                raise DcpcArgumentError(f"{name}: {flag} must be True or False, got {value!r}")
        validate.check_number(name, "epoch_start", epoch_start, -(2**31), 2**31 - 1)
        if programs is not None:
            validate.check_knob(name, "programs", "programs", programs)
        self.poison, self._epoch_start = poison, epoch_start
        self._timeout_s, self._timeout_ns = float(timeout_s), int(timeout_s * 1e9)
        self._guard = guard  # fingerprints, failure flags and the call order (the guard)
        # the torch steps' message to every peer before each step (gloo): a barrier over
        # all W ranks; off (dcpc run --no-handshake), a torch step pairs only through its
        # own collective, as on NCCL, so a race between other axes' kernels can show
        self._handshake_on = handshake
        self._fp = 0  # the fingerprint of the call being launched (set by _bind)
        self._fp_base = 0  # _fp before the call id (what a call plan keeps)
        # a failed wait on GPU traps (the process ends: its peers are flagged first);
        # DCPC_TRAP=0 (debugging, e.g. many ranks in one process, where a trap ends every
        # rank and its record): it records the error and returns, check_errors() raises it
        self._trap = self.device.type == "cuda" and os.environ.get("DCPC_TRAP", "1") != "0"
        self._clock = kernel_clock(self.device.type)  # the kernel's deadline
        self._wp2 = tiles.next_pow2(self.world)  # pointer tables are loaded as vectors
        self._check_each_call = self.device.type == "cpu" and self.backend != "torch"
        self._env_const, self._maxima = self._bind_sizes(check_sizes(name, sizes, self.SIZES))
        self._bind_mesh(self._env_const)  # dcpc.runtime.teams
        if isinstance(self.LOOP_WORLD, tuple) and self.mesh_shape != self.LOOP_WORLD:
            raise ValueError(
                f"{name}: this module's loops were unrolled for the mesh "
                f"{'x'.join(map(str, self.LOOP_WORLD))} (a trip count, an index, an offset or "
                f"an interleave names a mesh axis' size), but the mesh is "
                f"{'x'.join(map(str, self.mesh_shape))}; compile it with --world "
                f"{'x'.join(map(str, self.mesh_shape))}")
        self._check_proved()
        self._groups = axes.check_groups(
            name, groups, self.backends, self.MESH, self._axis_teams()) if groups else {}
        self._max_env = {**self._env_const, **self._maxima}
        self._env: list[dict[str, int]] = [dict(self._env_const) for _ in range(self.SLOTS)]
        if self.backend == "local" and programs is None:
            programs = self._local_program_cap()
        self._tune = self._make_tuning(programs, tuning)
        self._envs: dict[tuple, dict[str, int]] = {}  # interned envs (Signature.bind)
        self._memo: dict[tuple, tuple[Any, Any]] = {}  # (what, id(env)) -> (env, value)
        self._signatures = {
            method: Signature(
                method,
                [(b, self.BUFFERS[b].shape, self.BUFFERS[b].dtype) for b in params],
                self._env_const,
                self._maxima,
                self.device,
                self.LAYOUTS.get(method, ()),
                self._envs,
            )
            for method, params in self.METHODS.items()
        }
        # per split put, the run-time sizes its launch shape reads, and the values its
        # last call bound per slot (_split_sizes)
        self._put_sizes = {
            put: (sorted({s for e in (*(a for _, a in self.SCALARS[put]), *self.TILES[put])
                          for s in shapes.symbols(e)} & set(self._maxima)), [None] * self.SLOTS)
            for put in set(self.PUTS.values())
        }
        self._allocate()
        self._owned_tensors = self._owned()
        self._plans = {}  # call key -> what a repeat call does (dcpc.runtime.calls)
        self._fast = self.backend != "torch" and not self._mixed

    # ---- construction -------------------------------------------------------------
    def _bind_sizes(self, given: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        name = type(self).__name__
        env: dict[str, int] = {"W": self.world}
        maxima: dict[str, int] = {}
        for size, (kind, value) in self.SIZES.items():
            if kind == "axis":  # sizes a mesh axis (dcpc.runtime.teams): given, positive
                if not isinstance(given.get(size), int) or given[size] < 1:
                    raise DcpcArgumentError(
                        f"{name}: size {size} sizes mesh axis '{self.MESH[value][0]}': pass "
                        f"sizes={{'{size}': ...}} (the mesh's sizes multiply to W)"
                    )
                env[size] = given[size]
            if kind == "const":
                if given.get(size, value) != value:
                    raise DcpcArgumentError(
                        f"{name}: size {size} is the constant {value}, not {given[size]}"
                    )
                env[size] = value
        for size, (kind, value) in self.SIZES.items():
            if kind == "multiple_of":
                if size not in given:
                    raise DcpcArgumentError(
                        f"{name}: size {size} is bound at construction: "
                        f"pass sizes={{'{size}': ...}}"
                    )
                step = shapes.evaluate(value, env)
                if given[size] <= 0 or step <= 0 or given[size] % step:
                    raise DcpcArgumentError(
                        f"{name}: size {size}={given[size]} must be a positive multiple of "
                        f"{shapes.unparse(value)}={step} (W={self.world})"
                    )
                env[size] = given[size]
            elif kind == "max":
                top = given.get(size, value)
                if not 1 <= top <= value:
                    raise DcpcArgumentError(
                        f"{name}: size {size} can only be lowered from its maximum {value} "
                        f"(1..{value}), got {top}"
                    )
                maxima[size] = top
        return env, maxima

    def _make_tuning(self, programs: int | None, overrides: object) -> dict[str, Tune]:
        overrides = validate.check_tuning(type(self).__name__, overrides, self.TUNING)
        out = {}
        for step, knobs in self.TUNING.items():
            merged = {**knobs, **overrides.get(step, {})}
            if programs is not None and step in self.SIGNALLING and merged["programs"] > 1:
                merged["programs"] = programs
            elif self.device.type == "cpu" and "programs" not in overrides.get(step, {}):
                # the Triton interpreter runs programs one after another: few is fastest
                merged["programs"] = min(merged["programs"], CPU_PROGRAMS)
            if not 1 <= merged["programs"] <= 1024:
                raise DcpcArgumentError(
                    f"{type(self).__name__}: {step}: programs must be in 1..1024, got "
                    f"{merged['programs']}"
                )
            statics = {
                k: shapes.evaluate(e, self._max_env) for k, e in self.STATICS.get(step, {}).items()
            }
            spaces, fixed = [], []
            for e in self.TILES.get(step, ()):
                length, static = shapes.evaluate(e, self._max_env), self._static(e)
                spaces.append(tiles.pick(length, merged["block"], static))
                fixed.append(length if static else 0)
            out[step] = Tune(
                merged["programs"], merged["num_warps"], merged["block"], spaces, statics,
                merged.get("tiles_per_program", 1), fixed,
            )
        return out

    def _local_program_cap(self) -> int | None:
        """``local``: every rank's signalling kernels of every slot resident on one device
        at once (dcpc.runtime.local.program_cap); None when the tuning is already below."""
        from dcpc.runtime.local import program_cap

        knobs = [self.TUNING[s] for s in self.SIGNALLING if s in self.TUNING]
        if not knobs:
            return None
        warps = max(k["num_warps"] for k in knobs)
        cap = program_cap(self.device, self.world, self.SLOTS, warps)
        return cap if cap < max(k["programs"] for k in knobs) else None

    def _static(self, expr: tuple) -> bool:
        return not (shapes.symbols(expr) & set(self._maxima))

    def _numel(self, buf: Buf, env: Mapping[str, int]) -> int:
        return shapes.product(buf.shape, env)

    def _facts(self) -> list[tuple[str, int]]:
        """What every rank must have constructed alike (dcpc.runtime.rendezvous)."""
        facts = [("schedule", int(self.SOURCE_SHA256[:15] or "0", 16)),
                 ("backend", validate.BACKENDS.index(self.backend))]
        facts += [(f"size {n}", self._max_env[n]) for n, (kind, _) in self.SIZES.items()
                  if kind != "const"]
        if self.MESH:  # as many facts on every rank, whatever backend= and groups= it got
            facts += [(f"backend of axis {a}",
                       validate.BACKENDS.index(self.backends.get(a, self.backend)))
                      for a, _ in self.MESH]
            facts += [("groups= given", int(bool(self._groups)))]
        facts += [("guard", int(self._guard)), ("handshake", int(self._handshake_on)),
                  ("epoch_start", self._epoch_start)]
        for step, tune in self._tune.items():
            facts += [(f"tuning['{step}']['programs']", tune.programs),
                      (f"tuning['{step}']['block']", tune.block)]
        return facts

    def _allocate(self) -> None:
        if self.world > 1 and self.backend != "local":
            rendezvous.meet(self.group, self.rank, self.world, type(self).__name__,
                            self._facts(), self._timeout_s)
        elif self.world > 1:  # local: the same comparison over the threads' exchange
            facts = self._facts()
            mine = [len(facts), *(int(v) for _, v in facts)]
            theirs = dict(enumerate(self.group.all_gather_object(mine)))
            rendezvous._compare(type(self).__name__, self.rank, facts, theirs)
        signalling = [self._tune[s].programs for s in self.SIGNALLING] or [1]
        channels = max(len(self.STEPS), 1) * self.SLOTS
        requests = [sync.signal_nbytes(channels, self.world, max(signalling))]
        owners: list[tuple[str, int]] = []
        for name, buf in self.BUFFERS.items():
            if buf.kind in ("symmetric", "shared"):
                nbytes = self._numel(buf, self._max_env) * DTYPES[buf.dtype].itemsize
                for slot in range(self.SLOTS if buf.kind == "symmetric" else 1):
                    requests.append(nbytes)
                    owners.append((name, slot))
        local = [
            (name, self._numel(buf, self._max_env) * DTYPES[buf.dtype].itemsize * self.SLOTS)
            for name, buf in self.BUFFERS.items() if buf.kind == "output"
        ]
        self._check_bytes([(n, b) for (n, _), b in zip(owners, requests[1:], strict=True)]
                          + local)
        self._heap = (self._team_heap() if self._mixed else
                      make_heap(self.backend, self.group, self.device, self.poison))
        try:
            segments = self._heap.allocate(requests)
        except (MemoryError, OSError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and "allocate" not in str(exc):
                raise
            first = (str(exc).strip().splitlines() or ["?"])[0][:200]
            raise self._too_large(sum(requests), f"{type(exc).__name__}: {first}") from None
        self._bank = sync.SignalBank(
            segments[0], channels, self.world, max(signalling), self.device, self._epoch_start
        )
        self._local: dict[str, list[torch.Tensor]] = {}
        self._peers: dict[str, list[torch.Tensor]] = {}
        for (name, _slot), seg in zip(owners, segments[1:], strict=True):
            buf = self.BUFFERS[name]
            flat = seg.view(DTYPES[buf.dtype], (self._numel(buf, self._max_env),))
            self._local.setdefault(name, []).append(flat)
            self._peers.setdefault(name, []).append(seg.peer_ptrs)
        for name, buf in self.BUFFERS.items():
            if buf.kind == "shared":
                self._local[name] *= self.SLOTS
                self._peers[name] *= self.SLOTS
            elif buf.kind == "output":
                n = self._numel(buf, self._max_env)
                self._local[name] = [self._empty(n, buf.dtype)
                                     for _ in range(1 if buf.persist else self.SLOTS)]
                self._local[name] *= self.SLOTS if buf.persist else 1
            if buf.persist:  # its declared value at call 0, poison or not
                self._local[name][0].zero_()
        if self.TEAMS:
            self._make_team_tables()  # dcpc.runtime.teams
        self._scratch: dict[str, dict[str, list[torch.Tensor]]] = {}
        if self._on_torch:
            for step, table in self.SCRATCH.items():
                self._scratch[step] = {
                    key: [
                        self._empty(shapes.evaluate(e, self._max_env), dt)
                        for _ in range(self.SLOTS)
                    ]
                    for key, (e, dt) in table.items()
                }
            self._one = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._make_groups()  # dcpc.runtime.teams: ends with the CPU's one barrier
        self._make_guard(channels)
        sync_stream(self.device)  # this stream's initialisation done (not the device)
        self._heap.barrier()  # every rank's signal bank is initialised before any signal

    def _check_bytes(self, buffers: list[tuple[str, int]]) -> None:
        """Refuse sizes whose buffers no machine holds before anything is allocated."""
        total = sum(b for _, b in buffers)
        if total > MAX_BYTES:
            raise self._too_large(total, f"more than {MAX_BYTES} bytes (64 TiB)")
        if self.backend == "host" and self.world > 1:
            try:
                st = os.statvfs("/dev/shm")
                free = st.f_bavail * st.f_frsize
            except OSError:
                return
            if total > free:
                raise self._too_large(total, f"/dev/shm has {free} bytes free")

    def _too_large(self, total: int, why: str) -> DcpcArgumentError:
        name = type(self).__name__
        per = {}
        for b, buf in self.BUFFERS.items():
            if buf.kind != "engine":
                per[b] = self._numel(buf, self._max_env) * DTYPES[buf.dtype].itemsize
        biggest = max(per, key=per.get) if per else "?"
        named = {n for n, (kind, _) in self.SIZES.items() if kind != "const"}
        shape = self.BUFFERS[biggest].shape if per else ()
        used = sorted(set().union(*(shapes.symbols(e) for e in shape)) & named)
        sizes = ", ".join(f"{n}={self._max_env[n]}" for n in used)
        return DcpcArgumentError(
            f"{name}: sizes {sizes or '(constant)'} need {total} bytes of buffers on this "
            f"rank (the largest, '{biggest}', {per.get(biggest, 0)} bytes a slot): {why}; "
            "lower the sizes= maxima to what a call needs"
        )

    def _make_guard(self, channels: int) -> None:
        """Fingerprints, the call order, and the deadline keeper of this backend."""
        used: dict[str, list[str]] = {}
        for method, params in self.METHODS.items():
            names: set[str] = set()
            for _, e in self.SCALARS.get(method, ()):
                names |= shapes.symbols(e)
            for b in params:
                for e in self.BUFFERS[b].shape:
                    names |= shapes.symbols(e)
            used[method] = [*sorted(names & set(self._maxima)), CALL_ID]
        self._fps = sync.Fingerprints(
            used, {**self._maxima, CALL_ID: CALL_IDS - 1}, self.SOURCE_SHA256
        )
        self._order = _guard.CallOrder(list(self.METHODS), self.SLOTS)
        self._arms = (set(self.SIGNALLING) - self._on_torch
                      if self.world > 1 and self._check_each_call else set())
        self._watchdog = (
            sync.Watchdog(self._bank.errors, self._timeout_s, self._watch_peers)
            if self._arms else None
        )
        if self.device.type == "cuda" and self.backend != "torch":
            # compile and load the failure-flag kernel now: a JIT compile while a peer's
            # kernel spins can hang (one process, one GPU); flags are 0 on every rank here
            self._bank.flag_peers(self.rank, 0)
        self._handshake_with = None
        if (self._on_torch and self.world > 1 and self.device.type == "cpu"
                and self._handshake_on):
            self._handshake_with = _guard.TorchHandshake(
                [c.group for c in self._comms], self.rank, self.world, self.STEPS,
                self._timeout_s, self._fps,
            )

    def _empty(self, n: int, dtype: str) -> torch.Tensor:
        t = torch.zeros(n, dtype=DTYPES[dtype], device=self.device)
        if self.poison:
            poison_(t)
        return t

    # ---- per call --------------------------------------------------------------------
    def _bind(
        self,
        slot: int,
        method: str,
        tensors: tuple[torch.Tensor, ...],
        sizes: Mapping[str, int] | None,
        call_id: int | None = None,
    ) -> dict[str, int]:
        """Check the instance is usable, ``slot``, the call order; bind run-time sizes from
        the arguments, validate them; the call's fingerprint (with ``call_id``, when
        given); arm the deadline (CPU)."""
        if self._failed is not None or self._heap is None:
            raise self._unusable(method)
        if isinstance(slot, bool) or not (isinstance(slot, int) and 0 <= slot < self.SLOTS):
            raise DcpcArgumentError(
                f"{method}(): slot must be an int in 0..{self.SLOTS - 1}, got {slot!r}"
            )
        if sizes is not None and not isinstance(sizes, Mapping):
            raise DcpcArgumentError(f"{method}(): sizes must be a dict, got {sizes!r}")
        env = self._env[slot]
        if sizes:
            env = dict(env)
            for size, value in sizes.items():
                top = self._maxima.get(size)
                if top is None or isinstance(value, bool) or not isinstance(value, int):
                    raise DcpcArgumentError(
                        f"{method}(): sizes= binds run-time sizes {sorted(self._maxima)} to ints, "
                        f"got {size}={value!r}"
                    )
                if not 0 <= value <= top:
                    raise DcpcArgumentError(f"{method}(): size {size}={value} is outside 0..{top}")
                env[size] = value
        env = self._signatures[method].bind(tensors, env)
        if call_id is not None and (isinstance(call_id, bool) or not isinstance(call_id, int)):
            raise DcpcArgumentError(f"{method}(): call_id must be an int, got {call_id!r}")
        if self._guard:
            self._order.enter(method, slot)
            self._fp = self._memoised(("fp", method), env, lambda: self._fps.of(method, env))
            self._fp_base = self._fp  # without the call id: what a call plan keeps
            if call_id is not None and call_id % CALL_IDS:
                self._fp = self._with_call_id(method, env, call_id % CALL_IDS)
        self._env[slot] = env
        if self.PUTS:
            self._split_sizes(method, slot, env)
        if method in self._arms:
            self._watchdog.arm()  # type: ignore[union-attr]
        return env

    def _split_sizes(self, method: str, slot: int, env: Mapping[str, int]) -> None:
        """A split put keeps the sizes it launched with (per slot); its wait, which
        launches the put's grid from its own sizes (program i polls program i), must have
        the same: other sizes give another grid, whose programs wait for what the put's
        did not send (a timeout) or, unguarded, sum what has not landed. On every call,
        checked or replayed (calls._replay)."""
        put = self.PUTS.get(method)
        kept = self._put_sizes.get(put or method)
        if kept is None:
            return
        names, bound = kept
        if put is None:
            bound[slot] = env
            return
        before = bound[slot]
        for size in names if before is not None else ():
            if env.get(size) != before.get(size):
                raise DcpcArgumentError(
                    f"{method}(): the wait of the split put '{put}' runs on its sizes, but "
                    f"binds {size}={env.get(size)} where '{put}' bound {size}="
                    f"{before.get(size)} (slot {slot}): pass the put's sizes")

    def _with_call_id(self, method: str, env: Mapping[str, int], digit: int) -> int:
        if method in self._fps.exact:  # the call id is the last digit: add it
            return self._fp + digit
        return self._fps.of(method, {**env, CALL_ID: digit})

    def _watch_peers(self) -> None:
        """The watchdog's look, while a call waits (CPU): a peer whose process is gone
        (SIGKILL, a crash: it can flag nobody) gets FLAG_DIED in this rank's own bank, so
        a wait for it stops at once and names it, instead of spinning out timeout_s. The
        ranks of this heap run on this host (the host backend); others are not seen."""
        heap, flags = self._heap, self._bank.flags
        gone = getattr(heap, "gone", None)
        if gone is None:
            return
        for peer in range(self.world):
            if peer != self.rank and int(flags[peer]) == 0 and gone(peer):
                flags[peer] = sync.FLAG_DIED

    def _handshake(self, step_index: int, slot: int) -> None:
        """torch backend (gloo): fingerprint, failure notice and bounded wait per peer."""
        if self._handshake_with is not None and self._guard:
            step = self.STEPS[step_index]
            # a guarded step (when:) runs on some ranks only: the handshake is with
            # the peers that run it too (the checker proved they are its peers)
            ranks = (None if step not in self.WHEN else
                     {r for r in range(self.world) if self.runs(step, r)})
            self._handshake_with.exchange(
                step, sync.channel(step_index, slot, self.SLOTS), slot, self._fp, ranks,
            )

    def _unusable(self, method: str) -> DcpcFailedError:
        name = type(self).__name__
        if self._failed is not None:
            first = self._failed
            return DcpcFailedError(
                f"{method}(): this {name} instance failed earlier ({type(first).__name__}: "
                f"{first}); it cannot be used again (as an aborted NCCL communicator): close() "
                "it and construct a new instance on every rank"
            )
        return DcpcFailedError(
            f"{method}(): this {name} instance was closed; construct a new one on every rank"
        )

    def _fail(self, exc: BaseException) -> None:
        """Mark the instance failed (the first error only) and tell the peers: their
        waits for this rank stop at once (failure flags; the torch backend's notice)."""
        if self._notified:
            return
        self._notified = True
        if self._heap is not None:  # a call after close() leaves the instance "closed"
            self._failed = exc
        if self._watchdog is not None:
            self._watchdog.disarm()
        if self._handshake_with is not None:
            self._handshake_with.notify_failed()
        if self._heap is not None and self.backend != "torch":  # torch: no peer pointers
            self._bank.flag_peers(self.rank, sync.FLAG_FAILED)

    @staticmethod
    def _launch(tune: Tune, rows: int, cols: int) -> tuple[int, int, int]:
        """(programs, BLOCK_R, BLOCK_C) for a call over the first tile space [rows, cols].

        A call with few tiles gets shorter tiles (BLOCK_R halved, down to ``MIN_BLOCK``
        elements, while the call still fits in one wave of ``tune.programs``) so that more
        SMs share it: the latency of a small exchange is the time of one tile's loads and
        stores, and a second wave (or the fused op's second launch) costs more than a
        longer tile. Programs: one per ``tiles_per_program`` tiles, at most
        ``tune.programs``. Every rank computes the same launch from the same sizes, and
        program i's epoch advances only in launches that run it, on every rank alike."""
        block_r, block_c = tune.tiles[0]
        col_tiles = -(-cols // block_c)
        while (
            block_r > 1
            and (block_r // 2) * block_c >= MIN_BLOCK
            and -(-rows // (block_r // 2)) * col_tiles <= tune.programs
        ):
            block_r //= 2
        tiles = -(-rows // block_r) * col_tiles
        return max(1, min(tune.programs, -(-tiles // tune.tiles_per_program))), block_r, block_c

    @staticmethod
    def _fp8_tile(tune: Tune, block_r: int, block_c: int, group: int | None
                  ) -> tuple[int, int, int]:
        """(BLOCK_R, BLOCK_C, num_warps) of a launch that stores fp8 bytes into a peer's
        buffer (ragged_all_to_all.py.j2's quantising casts, 1 and 2): its [BLOCK_R, cols]
        tile (cols: the group, else BLOCK_C) holds at most FP8_VECTOR elements a thread,
        one row's vector (rows narrower than FP8_VECTOR: up to FP8_VECTOR rows' elements,
        which sm_90 code packs without byte pairs). The store's layout there is one byte
        a thread (a peer's pointer: no alignment known), so Triton 3.6 moves the bytes
        through shared memory; a thread with elements of two rows (an [8, 128] f32 tile
        on 4 warps) writes them as byte pairs (st.shared.v2.b8), which stored wrong bytes
        on an H100 where byte stores did not (benchmarks/diag/grouped_cast_a2a/README.md;
        dcpc.harness.ptx finds them). A group wider than 4 warps' vectors takes more
        warps."""
        per_warp = WARP_THREADS * FP8_VECTOR
        warps = max(tune.num_warps, (group or 0) // per_warp)
        block_c = min(block_c, per_warp * warps)
        return max(1, min(block_r, per_warp * warps // (group or block_c))), block_c, warps

    def _memoised(self, what: tuple, env: Mapping[str, int], make: Any) -> Any:
        """``make()`` once per (what, env object): envs are interned (Signature.bind), so
        the same sizes give the same object, and a cached value stays valid for it."""
        key = (what, id(env))
        hit = self._memo.get(key)
        if hit is not None and hit[0] is env:
            return hit[1]
        value = make()
        if len(self._memo) >= 4096:
            self._memo.clear()
        self._memo[key] = (env, value)
        return value

    def _scalars(self, step: str, env: Mapping[str, int]) -> list[int]:
        return self._memoised(("scalars", step), env, lambda: self._scalars_of(step, env))

    def _scalars_of(self, step: str, env: Mapping[str, int]) -> list[int]:
        try:
            return [shapes.evaluate(e, env) for _, e in self.SCALARS[step]]
        except KeyError as exc:
            raise DcpcArgumentError(
                f"{step}(): size {exc.args[0]} is not bound yet in this slot; pass "
                f"sizes={{'{exc.args[0]}': ...}} or call a step that binds it first"
            ) from None

    def _view(self, name: str, slot: int, env: Mapping[str, int]) -> torch.Tensor:
        """The run-time view of a module-owned buffer: its first elements, contiguous
        (memoised per env: the same view object while the sizes repeat)."""
        return self._memoised(("view", name, slot), env, lambda: self._view_of(name, slot, env))

    def _view_of(self, name: str, slot: int, env: Mapping[str, int]) -> torch.Tensor:
        buf = self.BUFFERS[name]
        try:
            shape = shapes.shape(buf.shape, env)
        except KeyError as exc:
            raise DcpcArgumentError(
                f"size {exc.args[0]} of buffer '{name}' is not bound yet in slot {slot}; pass "
                f"sizes={{'{exc.args[0]}': ...}} or call the step that binds it first"
            ) from None
        n = 1
        for d in shape:
            n *= d
        return self._local[name][slot][:n].view(shape)

    def _poison_output(self, name: str, slot: int) -> None:
        if self.poison and self.BUFFERS[name].kind == "output" \
                and not self.BUFFERS[name].persist:
            poison_(self._local[name][slot])
            calls.note(self._local[name][slot])  # a repeat call poisons it too

    def _check(self, step_index: int) -> None:
        """CPU backends: raise the error a kernel recorded (no GPU sync is ever done here)."""
        if self._watchdog is not None:
            self._watchdog.disarm()
        if self._check_each_call:
            self._bank.check_errors(self.STEPS, self.rank, self._fps, self._timeout_s)

    # ---- public -------------------------------------------------------------------------
    def check_errors(self) -> None:
        """Raise the error a kernel recorded, if any (synchronises with the device):
        ``DcpcTimeoutError``, ``DcpcContractError`` or ``DcpcPeerFailedError``."""
        if self._heap is None:
            raise self._unusable("check_errors")
        try:
            self._bank.check_errors(self.STEPS, self.rank, self._fps, self._timeout_s)
        except BaseException as exc:
            self._fail(exc)
            raise

    def buffer(
        self, name: str, slot: int = 0, sizes: Mapping[str, int] | None = None
    ) -> torch.Tensor:
        """The local instance of a module-owned buffer: sized for ``sizes`` (a call's size
        values, e.g. ``{"T": 8, "B": 2}``; missing ones take their maxima), else for the
        maxima. What an engine step declared as reading it (``external: reads``) sees."""
        if self._heap is None:
            raise self._unusable("buffer")
        if name not in self.BUFFERS or self.BUFFERS[name].kind == "engine":
            # b_rot<c>: slot (r + c) mod W of b on rank r (dcpc.topology.ROTATION)
            held = [ROTATION.format(name, c) for c in rotations(self.BUFFERS).get(name, [])]
            raise KeyError(f"{type(self).__name__}: no module-owned buffer {name!r}" + (
                f"; it is held as {', '.join(held)}: on rank r, {name}_rot<c> is slot "
                f"(r + c) mod W of {name} (an index that rotates the rank): ask for those"
                if held and name not in self.BUFFERS else ""))
        return self._view_of(name, slot, {**self._max_env, **(sizes or {})})

    def close(self) -> None:
        """Release the symmetric heap (idempotent). Views handed out must not be used after.

        Peers still waiting for this rank stop at once (its failure flag: closed); any
        later call on this instance raises ``DcpcFailedError``."""
        heap, self._heap = getattr(self, "_heap", None), None
        if heap is None:
            return
        if getattr(self, "_watchdog", None) is not None:
            self._watchdog.close()  # type: ignore[union-attr]
        if self._failed is None and self.backend != "torch":
            try:
                self._bank.flag_peers(self.rank, sync.FLAG_CLOSED)
            except Exception:  # noqa: BLE001 (closing never fails; peers then time out)
                pass
        heap.close()

    def __enter__(self) -> ScheduleModule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ModuleOfWorlds(ScheduleModule):
    """The class of a module compiled for several W (its loops name W): constructing it
    builds the class of ``LOOP_WORLDS`` for the group's W, so the engine gets an object
    with that W's hop methods (``send_h1`` at W=4); any other W is refused by name."""

    def __new__(cls, group: Any = None, *args: Any, **kwargs: Any) -> ScheduleModule:  # type: ignore[misc]
        # the variant is no subclass of ``cls``: type.__call__ does not init it again
        return cls.for_world(group_rank_world(group)[1])(group, *args, **kwargs)
