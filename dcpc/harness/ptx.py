"""What the GPU runs, read on a machine without one: the emitted kernels compiled by
Triton for a Hopper target (sm_90) and their PTX checked for what the CPU interpreter
cannot show.

The interpreter runs one program at a time, has no threads inside a block and divides
in IEEE arithmetic, so three classes of GPU-only error pass every CPU run. The first is
read here from the compiled code itself; the second and third too:

- ``release-without-barrier``: a signal (a release atomic or store, gpu or system scope)
  with a global store of the block before it and no block barrier (``bar.sync``) in
  between: the release orders only its own thread's stores, so a peer that acquires the
  signal may read the other threads' data before it lands.
- ``acquire-without-barrier``: a data load after a wait's acquire with no block barrier
  in between: only the acquiring thread is ordered after the peer's release.
- ``approximate-division``: ``div.full.f32`` / ``div.approx`` (what Triton emits for
  ``/`` on fp32): up to 2 ulp off the IEEE quotient the float64 reference and the
  interpreter compute, e.g. a per-token fp8 scale one ulp off; ``tl.math.div_rn`` is
  the IEEE division.
- ``byte-pair-shared-store``: ``st.shared.v2.b8`` / ``.v4.b8``: Triton 3.6 moving a
  byte tile (fp8) to a store's layout through shared memory in byte vectors, a thread's
  bytes of two rows side by side. An [8, 128] f32 tile on 4 warps quantised this way
  stored wrong fp8 bytes on an H100 where the same kernel storing byte by byte did not
  (benchmarks/diag/grouped_cast_a2a/README.md; the PTX reads right, so the fault is
  below it); ragged_all_to_all.py.j2 launches its fp8 stores around it.

How: ``capture`` runs the schedule's module on CPU (Triton's interpreter, ranks as
threads) and records every launch's kinds of arguments (each tensor's dtype and 16-byte
alignment, each integer's value, every constexpr), which is what Triton specialises a
kernel on; ``compile_ptx`` (in a process without the interpreter) binds the same kinds of
arguments through Triton's own specialisation and compiles each variant for sm_90, no
GPU needed; ``check_ptx`` reads the PTX. ``check_schedules`` does all three in two child
processes (dcpc.harness.launch). The linear reading of the PTX is a heuristic: a
release inside a loop whose stores follow it in the text would be missed (generated
kernels release after their store loops).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCH = 90  # Hopper (H100/H200): what the project runs on
WARP_SIZE = 32

_RELEASE = re.compile(r"\b(atom|red|st)\.[\w.]*\brelease\b[\w.]*")
_ACQUIRE = re.compile(r"\b(atom|ld)\.[\w.]*\bacquire\b[\w.]*")
_STORE = re.compile(r"\bst\.global\b")
_LOAD = re.compile(r"\bld\.global\b")
_BARRIER = re.compile(r"\b(bar|barrier)\.(sync|red|cta\.sync)\b|\bbar\.sync\b")
_RANK_BRANCH = re.compile(r"\bRANK\s*==|==\s*RANK\b")  # a kernel with a rank's own branch
_DIVISION = re.compile(r"\bdiv\.(full|approx)\.f32\b|\brcp\.approx\.f32\b")
_BYTE_PAIR = re.compile(r"\bst\.shared\.v[24]\.b8\b")


@dataclass(frozen=True)
class Finding:
    kernel: str
    code: str  # release-without-barrier | acquire-without-barrier | approximate-division
    # | byte-pair-shared-store
    line: int  # in the kernel's PTX
    text: str  # the instruction

    def render(self) -> str:
        return f"{self.kernel}: {self.code} at PTX line {self.line}: {self.text}"


def check_ptx(kernel: str, ptx: str) -> list[Finding]:
    """The findings in one kernel's PTX (see the module docstring)."""
    out: list[Finding] = []
    lines = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    last_store = last_barrier = -1
    pending_acquire = -1  # an acquire not yet followed by a block barrier
    for i, ln in enumerate(lines):
        if not ln:
            continue
        if _DIVISION.search(ln):
            out.append(Finding(kernel, "approximate-division", i + 1, ln))
        if _BYTE_PAIR.search(ln):
            out.append(Finding(kernel, "byte-pair-shared-store", i + 1, ln))
        if _BARRIER.search(ln):
            last_barrier = i
            pending_acquire = -1
            continue
        if _RELEASE.search(ln):
            if last_store > last_barrier:
                out.append(Finding(kernel, "release-without-barrier", i + 1, ln))
            continue
        if _ACQUIRE.search(ln):
            pending_acquire = i
            continue
        if _STORE.search(ln):
            last_store = i
        elif (_LOAD.search(ln) and pending_acquire >= 0 and ".volatile" not in ln
              and ".acquire" not in ln and ".relaxed" not in ln):
            out.append(Finding(kernel, "acquire-without-barrier", i + 1, ln))
            pending_acquire = -1
    return out


# ---- capture: the launches of a run on CPU (in a process with the interpreter) ----------
def _encode(value: Any) -> tuple:
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    return ("value", value)


def _source(fn: Any) -> str:
    """A kernel's Python source (a JITFunction's ``src``; the interpreter's wraps ``fn``)."""
    import inspect

    src = getattr(fn, "src", None)
    if src:
        return str(src)
    try:
        return inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return ""


def capture_rank0(process: int, processes: int, *, runs: list[dict[str, Any]],
                  reference: bool = False) -> list[list[tuple]]:
    """For each run (schedule_path, module_path, world, calls, programs, mesh): run the
    module on CPU (ranks as threads) and return rank 0's launches: (kernel, args,
    constexprs) with arguments as Triton specialises on them (``_encode``). Another rank's
    variants differ in its RANK constants alone, which matters where a kernel branches on
    its rank (``RANK == ROOT``, ``RANK == WORLD - 1``: rank 0 never compiles the other
    side): of those kernels the last rank's launches too.

    The run is ``worker.run_rank``'s own less what only reads it: without ``reference``
    no float64 simulation and no comparison (``run_rank(reference=False)``: the same
    module, inputs and engine steps' values, so the same launches), and a rank whose
    wait polls a signal not there yet gives its peers the interpreter at once
    (``_polls_yield``: when threads run, not what they compute). With ``reference``:
    a whole CPU ``dcpc run`` of each rank, as the capture was before
    (tests/codegen/test_emitted_ptx.py checks both launch the same variants)."""
    import threading

    from dcpc.harness import worker
    from dcpc.runtime import fastlaunch
    from dcpc.runtime.local import LocalGroup

    del process, processes
    seen: dict[tuple, None] = {}
    last = [0]  # the run's last rank
    lock = threading.Lock()
    original = fastlaunch.FastKernel.launch
    branches: dict[int, bool] = {}  # id(kernel) -> its source branches on RANK: per run

    def branching(fn: Any) -> bool:
        found = branches.get(id(fn))
        if found is None:
            found = branches[id(fn)] = bool(_RANK_BRANCH.search(_source(fn)))
        return found

    def launch(self: Any, grid: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
        rank = kwargs.get("GRANK", kwargs.get("RANK", 0))
        if rank == 0 or (rank == last[0] and branching(self.fn)):
            key = (self.__name__, tuple(_encode(a) for a in args),
                   tuple((k, _encode(v)) for k, v in kwargs.items()))
            with lock:
                seen.setdefault(key, None)
        return original(self, grid, args, kwargs)

    out = []
    unyield = None
    try:
        fastlaunch.FastKernel.launch = launch  # type: ignore[method-assign]
        unyield = None if reference else _polls_yield()
        for run in runs:
            seen.clear()
            branches.clear()  # a kernel of a run lives as long as its run: ids stay its own
            world = run["world"]
            last[0] = world - 1
            group = LocalGroup(world, "cpu")
            # the capture's run: the ranks share the calls' inputs (run_local's way)
            only = {} if reference else {
                "sims": worker.SharedSims(world, reference=False), "check": False,
                "reference": False}
            group.run(lambda rank, run=run, world=world, only=only: worker.run_rank(
                rank.rank, world, group=rank, schedule_path=run["schedule_path"],
                module_path=run["module_path"], backend="local", calls=run["calls"],
                seed=0, jitter_s=0.0, programs=run["programs"], mesh=run["mesh"], **only))
            out.append(list(seen))
    finally:
        fastlaunch.FastKernel.launch = original  # type: ignore[method-assign]
        if unyield is not None:
            unyield()
    return out


POLL_YIELD_S = 1e-4  # a polling rank's pause: its peers take the interpreter meanwhile


def _polls_yield() -> Any:
    """Make the interpreter's atomic add of nothing (a wait's poll of a signal: ``tl.
    atomic_add(cells, 0, ...)``) pause ``POLL_YIELD_S`` after it reads, GIL released:
    ranks are threads under one GIL, so a rank spinning on a peer's signal otherwise
    polls for a whole switch interval (5 ms) each turn while the peer that would set it
    waits: most of a waiting schedule's CPU time. Timing only: every value read and
    written is the same. Returns the undo."""
    import time

    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    original = builder.create_atomic_rmw

    def create_atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, sem: Any,
                          scope: Any) -> Any:
        got = original(self, op, ptr, val, mask, sem, scope)
        if op == ir.ATOMIC_OP.ADD and not np.any(val.data):
            time.sleep(POLL_YIELD_S)
        return got

    builder.create_atomic_rmw = create_atomic_rmw  # type: ignore[method-assign]

    def undo() -> None:
        builder.create_atomic_rmw = original  # type: ignore[method-assign]

    return undo


# ---- compile: PTX for sm_90 (in a process without the interpreter) --------------------
def _decode(value: tuple) -> Any:
    import torch

    if value[0] != "tensor":
        return value[1]
    t = torch.empty(64, dtype=getattr(torch, value[1]))
    return t if value[2] else t[1:]  # 16-byte aligned, or not: as captured


def compile_ptx(process: int, processes: int, *, modules: list[str],
                launches: list[list[tuple]]) -> list[dict[str, str]]:
    """PTX of every captured launch's kernel variant, per module, compiled for sm_90 by
    Triton's own specialisation of the same kinds of arguments; keyed ``kernel#n``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from dcpc.runtime.clock import kernel_clock
    from dcpc.runtime.loading import import_file

    del process, processes
    target = GPUTarget("cuda", ARCH, WARP_SIZE)
    backend = make_backend(target)
    out: list[dict[str, str]] = []
    for k, (path, captured) in enumerate(zip(modules, launches, strict=True)):
        module = import_file(path, f"dcpc_ptx_module{k}")
        ptx: dict[str, str] = {}
        for n, (name, args, kwargs) in enumerate(captured):
            fn = getattr(module, name).fn  # the JITFunction under dcpc's FastKernel
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            values = [_decode(a) for a in args]
            named = {key: _decode(v) for key, v in kwargs}
            if "CLOCK" in named:  # the capture ran on CPU: the GPU's wait (its global timer)
                named["CLOCK"] = kernel_clock("cuda")
            bound, specialization, options = binder(*values, **named)
            options, signature, constexprs, attrs = fn._pack_args(
                backend, named, bound, specialization, options)
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=target, options=options.__dict__)
            ptx[f"{name}#{n}"] = compiled.asm["ptx"]
        out.append(ptx)
    return out


def check_schedules(schedules: list[tuple[str | Path, Any]], *, calls: int = 3,
                    programs: int | None = 2, patch: tuple[tuple[str, str], ...] = (),
                    timeout_s: float = 900.0) -> list[tuple[list[Finding], int]]:
    """For each (schedule file, world): compile it, capture rank 0's launches of a CPU
    run, compile them for sm_90 and check their PTX: (findings, kernel variants checked)
    per schedule. Two child processes in all (one with the interpreter, one without).
    ``patch``: (old, new) edits of every module's text (mutation tests)."""
    from dcpc.harness.launch import launch

    with tempfile.TemporaryDirectory(prefix="dcpc-ptx-") as tmp:
        runs = _runs(schedules, Path(tmp), calls, programs, patch)
        modules = [run["module_path"] for run in runs]
        launches = _capture(runs, reference=False, timeout_s=timeout_s)
        done = launch("dcpc.harness.ptx:compile_ptx", 1, {
            "modules": modules, "launches": launches}, timeout_s=timeout_s,
            interpret=False)
        (compiled,) = done.outcomes
        if compiled.status != "ok":
            raise RuntimeError(f"compiling for sm_{ARCH} failed: {compiled.error}\n"
                               f"{compiled.traceback}")
    return [([f for name, ptx in per.items() for f in check_ptx(name, ptx)], len(per))
            for per in compiled.value]


def capture_schedules(schedules: list[tuple[str | Path, Any]], *, reference: bool,
                      calls: int = 3, programs: int | None = 2,
                      timeout_s: float = 900.0) -> list[list[tuple]]:
    """What ``check_schedules`` compiles, per (schedule file, world): rank 0's launches
    (``capture_rank0``: the capture's run, or with ``reference`` a whole CPU run)."""
    with tempfile.TemporaryDirectory(prefix="dcpc-ptx-") as tmp:
        return _capture(_runs(schedules, Path(tmp), calls, programs, ()),
                        reference=reference, timeout_s=timeout_s)


def _runs(schedules: list[tuple[str | Path, Any]], tmp: Path, calls: int,
          programs: int | None, patch: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    """Each schedule compiled into ``tmp``: ``capture_rank0``'s runs."""
    from dcpc.harness.run import compile_to
    from dcpc.lang.mesh import MeshWorld

    runs = []
    for k, (path, world) in enumerate(schedules):
        folder = tmp / str(k)
        folder.mkdir()
        used, module, _, _ = compile_to(str(path), folder, world, patch=patch)
        mesh = list(world.shape) if isinstance(world, MeshWorld) else None
        runs.append({"schedule_path": used, "module_path": module, "world": int(world),
                     "calls": calls, "programs": programs, "mesh": mesh})
    return runs


def _capture(runs: list[dict[str, Any]], *, reference: bool, timeout_s: float
             ) -> list[list[tuple]]:
    """``capture_rank0`` in a child with the interpreter."""
    from dcpc.harness.launch import launch

    got = launch("dcpc.harness.ptx:capture_rank0", 1, {"runs": runs, "reference": reference},
                 timeout_s=timeout_s)
    (captured,) = got.outcomes
    if captured.status != "ok":
        raise RuntimeError(f"capturing the launches failed: {captured.error}\n"
                           f"{captured.traceback}")
    return captured.value
