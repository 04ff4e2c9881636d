"""The ``local`` backend: W ranks as threads of ONE process on ONE device.

For tests and one-GPU benchmarks at any W (torch symmetric memory refuses two ranks on
one GPU). ``LocalGroup(W)`` stands for a process group: ``group.run(fn)`` runs
``fn(rank)`` in W threads, each with its own CUDA stream, and every rank constructs
its module instance with ``rank`` as the group (construction stays collective, across
the threads). Peers' segments are plain allocations on the same device; their
addresses go into the same pointer tables the ``symm_mem`` backend uses, so the
generated kernels run unchanged.

What one process needs that W processes do not (measured on one H200, docs/engines.md):

- co-residency: every rank's kernels share one GPU, and a wait spins on a peer's
  program that must be resident too. ``program_cap`` bounds the programs of a
  signalling launch so that W ranks x slots in flight all fit at once; the module
  applies it for ``local`` unless ``programs=`` is given.
- streams: no rank's kernel may queue behind a peer's spinning one. Every rank gets
  distinct streams, made together (``rank.stream``, ``rank.extra_streams``: torch's pool
  is round robin, so a stream made later may be a peer's), and
  ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (set before CUDA starts) gives them separate
  hardware queues (the default 8 makes streams share queues). W <= 10 on CUDA.
- warm-up: all ranks share one CUDA context; a JIT compile or module load in one thread
  while a peer's kernel spins hung. Run every call once inside ``compile_only()``
  (compiles and loads every kernel, launches nothing), then ``rank.barrier()``; set
  ``CUDA_MODULE_LOADING=EAGER`` before CUDA starts (``LocalGroup`` does it when it can);
  allocate nothing while kernels may spin. The warm-up also grows the context's local
  memory to what every loaded kernel needs: the driver grows it at a kernel's first
  launch only with the device idle, which a spinning peer never lets happen.
- CUDA graphs: ``with rank.capture(graph):`` captures one rank after another (capture
  synchronises the device on entry); replays then run concurrently.
- CPU (``TRITON_INTERPRET=1``): Triton 3.6's interpreter patches ``triton.language``
  around every launch and keeps the program id in one global builder, so two threads
  inside kernels break each other. ``LocalGroup`` on CPU installs a shim: the language is
  patched once and kept, the program id and grid are per thread. Spin loops then run in
  Python, and the GIL lets peers progress.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpc.runtime.clock import thread_cpu_s, wall_timeout
from dcpc.runtime.heap import ALIGN, Segment, SymmetricBuffer, aligned_offsets, poison_

STREAM_POOL = 32  # torch's streams per device and priority, handed out round robin
EXTRA_STREAMS = 2  # per rank, besides its own: LocalRank.extra_streams
CPU_PROGRAMS = 4  # the interpreter runs programs one after another: few is fastest
ASSUMED_REGS = 255  # registers per thread assumed by program_cap (the hardware maximum)
# Programs per SM that program_cap counts on: 1, conservative. On one H200 the kernels'
# resources allow 2 or more (out_exchange: 222 registers, 2 per SM; residency() reports
# them); a DBO hang seen at 2 per SM is not told apart yet from a mid-run compile (see
# compile_only), so 1 stays until two slots run clean at 2.
PROGRAMS_PER_SM = 1
WARP = 32


def _brief(exc: BaseException, limit: int = 6000) -> str:
    """A failed rank's traceback, at most ``limit`` characters: the start of the text
    (where the chain begins) and the end (the innermost frames and the error itself)."""
    text = "".join(traceback.format_exception(exc))
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + "\n  [...]\n" + text[-(limit - head):]


class LocalRankError(RuntimeError):
    """A rank of a ``LocalGroup.run`` failed or did not finish in time. ``launch_status``:
    the status the launcher gives the process that raised it (dcpc.harness.launch: a
    ``local`` run's one process stands for its W ranks, which hung or timed out)."""

    launch_status = "error"


class LocalRankHang(LocalRankError):
    """Ranks of a ``LocalGroup.run`` stopped: none said anything new (``LocalRank.progress``)
    for the stall bound, or, without one, they were not done at the deadline."""

    launch_status = "hung"


class LocalRankTimeout(LocalRankError):
    """Ranks of a ``LocalGroup.run`` still progressing at its deadline: a slow run, not a
    hang (a larger timeout lets it finish)."""

    launch_status = "timeout"


POLL_S = 0.5  # how often LocalGroup.run looks at its ranks' progress
# where the interpreter's and installed libraries' files lie: a hang report's frames
# from these are a library's, not the caller's own code (LocalGroup._where)
LIBRARY_PREFIXES = tuple(sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib"))


def program_cap(device: torch.device, world: int, slots: int, num_warps: int = 4,
                regs_per_thread: int = ASSUMED_REGS) -> int:
    """Programs per signalling launch so that ``world`` ranks x ``slots`` in flight are
    all resident at once: SMs x blocks per SM // (world x slots).

    Blocks per SM: ``PROGRAMS_PER_SM`` (1), and never more than threads (``num_warps``
    x 32 per program) and registers (``regs_per_thread``, 255 unless known) allow;
    ``residency`` reports the kernels' real counts after warm-up. On CPU: 4."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    props = torch.cuda.get_device_properties(device)
    threads = WARP * num_warps
    by_threads = props.max_threads_per_multi_processor // threads
    regs_per_warp = -(-regs_per_thread * WARP // 256) * 256  # allocation unit: 256 per warp
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    by_regs = regs_sm // (regs_per_warp * num_warps)
    per_sm = max(1, min(by_threads, by_regs, 32, PROGRAMS_PER_SM))
    return max(1, props.multi_processor_count * per_sm // (world * slots))


# ---- warm-up: compile and load every kernel, launch nothing ------------------------------
class _ThreadState(threading.local):
    compile_only = False  # a class default: reading it raises nothing (every launch reads it)


_tls = _ThreadState()
_record_lock = threading.Lock()
_patch_lock = threading.Lock()
_loaded: dict[str, dict[str, int]] = {}  # kernel name/hash -> resources (for residency)


def _install_compile_only() -> None:
    """Wrap ``JITFunction.run`` once: inside ``compile_only()`` a launch compiles and
    loads its kernel (``_init_handles``) and returns without launching."""
    import triton.runtime.jit as jit

    with _patch_lock:
        if getattr(jit.JITFunction.run, "_dcpc_local", False):
            return
        original = jit.JITFunction.run

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if not getattr(_tls, "compile_only", False):
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            # Triton's per-device caches are a defaultdict: two ranks' first launches at
            # once can each create one, and the variant compiled into the lost one is
            # compiled again mid-run (a hang). Create it once, under a lock.
            from triton.runtime.driver import driver

            device = driver.active.get_current_device()
            if device not in self.device_caches:
                with _patch_lock:
                    self.device_caches[device]
            # ranks compile at once (each its own RANK variant; Triton releases the GIL in
            # its passes and ptxas); a duplicate compile of one key is harmless
            kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
            init = getattr(kernel, "_init_handles", None)
            if init is not None:
                init()
                with _record_lock:
                    _record(kernel)
                    _reserve_local_memory(kernel)
            return kernel

        run._dcpc_local = True  # type: ignore[attr-defined]
        jit.JITFunction.run = run  # type: ignore[method-assign]


def _record(kernel: Any) -> None:
    meta = getattr(kernel, "metadata", None)
    regs = getattr(kernel, "n_regs", None)
    if meta is None or regs is None:
        return
    _loaded[f"{kernel.name}:{str(getattr(kernel, 'hash', ''))[:8]}"] = {
        "regs": int(regs), "spills": int(getattr(kernel, "n_spills", 0)),
        "shared": int(getattr(meta, "shared", 0)), "num_warps": int(meta.num_warps),
        "local_bytes": local_bytes(kernel)}


_CU_LIMIT_STACK_SIZE = 0  # CUlimit: per-thread local memory the context keeps
_CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3  # CUfunction_attribute


@functools.cache
def _cuda_driver() -> Any:
    """The CUDA driver library, opened once (it was opened again for every kernel)."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def local_bytes(kernel: Any) -> int:
    """Per-thread local memory (spills, stack frame) of a loaded kernel; 0 off CUDA."""
    import ctypes

    handle = getattr(kernel, "function", None)
    if not handle or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    value = ctypes.c_int(0)
    if _cuda_driver().cuFuncGetAttribute(ctypes.byref(value),
                                         _CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                         ctypes.c_void_p(handle)) != 0:
        return 0
    return value.value


def _reserve_local_memory(kernel: Any) -> None:
    """Grow the context's per-thread local memory to what ``kernel`` needs, now (in
    warm-up, nothing spins). Otherwise its first launch grows it, and the driver does
    that only with the device idle: queued behind a rank's spinning kernel while the
    peers that would release it cannot launch (one context), that was the all_reduce
    ``reduce: lse`` hang at W = 4 and 8 (its merge spills: 2.7 KB per thread at W=4,
    6 KB at W=8, past the default 1 KB; benchmarks/diag/all_reduce_lse_hang)."""
    import ctypes

    need = local_bytes(kernel)
    if need <= 0:
        return
    cuda = _cuda_driver()
    have = ctypes.c_size_t(0)
    if cuda.cuCtxGetLimit(ctypes.byref(have), _CU_LIMIT_STACK_SIZE) != 0:
        return
    if need > have.value:
        code = cuda.cuCtxSetLimit(_CU_LIMIT_STACK_SIZE, ctypes.c_size_t(-(-need // 16) * 16))
        if code != 0:
            raise RuntimeError(f"cuCtxSetLimit(stack size, {need}) failed: CUresult {code} "
                               f"(kernel {getattr(kernel, 'name', '?')} needs {need} bytes "
                               "of local memory per thread)")


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """In this thread, Triton launches compile and load their kernels but run nothing.

    Run each call an engine will make (same sizes, same slots) once inside it, on every
    rank, then ``rank.barrier()``: afterwards no JIT compile or module load can happen
    while a peer's kernel spins. Same means what Triton specialises on: integer arguments
    equal to 1 or divisible by 16, and each pointer's 16-byte alignment (a row view of a
    table whose rows are not 16-byte multiples is a new variant every few rows: seen as a
    hang in DBO on one H200). Torch ops inside still run (their results are garbage only
    where they read a kernel's output)."""
    _install_compile_only()
    before = getattr(_tls, "compile_only", False)
    _tls.compile_only = True
    try:
        yield
    finally:
        _tls.compile_only = before


def sync_stream(device: torch.device | str) -> None:
    """Wait until this thread's current stream on ``device`` has run what it was given;
    never the whole device (with ranks as threads a peer's kernel may be spinning).
    Nothing on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to the host, safe while peers' kernels may spin: this thread's stream
    is synchronised first, then copied. A blocking copy through pageable host memory
    (``.cpu()``, ``.item()``, ``.tolist()``; and the other way, ``.to("cuda")`` of a
    CPU tensor) issued while this rank's stream still waits on a peer holds the CUDA
    driver's staging buffer until it is done, and a peer's own copy needs that buffer
    before it can launch what this rank waits for: a hang (seen on one H200 with two
    ranks, each reading results with ``.cpu()``). Copy inputs to the device before the
    calls, or after a stream sync."""
    sync_stream(t.device)
    return t.cpu()


def residency(device: torch.device | None = None) -> dict[str, Any]:
    """Per kernel loaded in warm-up: registers, shared memory, warps and how many of its
    programs fit on one SM; with the SM count, what a cap could be given the real counts."""
    out: dict[str, Any] = {"kernels": dict(_loaded)}
    if device is None or device.type != "cuda":
        return out
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    per_sm = []
    for info in _loaded.values():
        warps = max(1, info["num_warps"])
        regs_per_warp = -(-max(info["regs"], 1) * WARP // 256) * 256
        fits = [props.max_threads_per_multi_processor // (WARP * warps),
                regs_sm // (regs_per_warp * warps), 32]
        if info["shared"]:
            fits.append(smem_sm // info["shared"])
        info["programs_per_sm"] = max(0, min(fits))
        per_sm.append(info["programs_per_sm"])
    out["sms"] = props.multi_processor_count
    out["min_programs_per_sm"] = min(per_sm) if per_sm else None
    return out


# ---- the CPU interpreter, made usable from several threads -------------------------------
def _install_interpreter_threads() -> None:
    """Triton 3.6's interpreter is not thread-safe (see the module doc); patch it once."""
    from triton.runtime import interpreter

    with _patch_lock:
        if getattr(interpreter, "_dcpc_threads", False):
            return
        state = threading.local()

        def getter(name: str, default: Any) -> property:
            return property(lambda self: getattr(state, name, default),
                            lambda self, value: setattr(state, name, value))

        builder = type(interpreter.interpreter_builder)
        builder.grid_idx = getter("grid_idx", None)  # type: ignore[attr-defined]
        builder.grid_dim = getter("grid_dim", (1, 1, 1))  # type: ignore[attr-defined]
        original = interpreter._patch_lang
        kept: dict[tuple[int, ...], Any] = {}
        # One lock for everything that reads or writes a kernel module's globals: the
        # first rewrite of a jit function adds the interpreter's names to them
        # (FunctionRewriter._compile_and_exec) while another rank's thread may be
        # iterating them to patch the language ("dictionary changed size during
        # iteration", seen under load).
        globals_lock = threading.RLock()

        class _Kept:
            def restore(self) -> None:
                """The interpreted language stays patched: another thread may be inside."""

        def patch_once(fn: Any) -> Any:
            with globals_lock:
                names = fn.__globals__.copy()  # one C-level copy under the GIL
                key = tuple(sorted(id(v) for v in names.values()
                                   if v is interpreter.tl or v is interpreter.tl.core))
                if key not in kept:
                    kept[key] = original(fn)
            return _Kept()

        rewrite = interpreter.InterpretedFunction.rewrite

        def rewrite_locked(self: Any) -> Any:
            with globals_lock:
                return rewrite(self)

        interpreter._patch_lang = patch_once
        interpreter.InterpretedFunction.rewrite = rewrite_locked  # type: ignore[method-assign]
        import triton

        if triton.__version__.startswith("3.6."):  # what the two below were measured on
            interpreter._get_np_dtype = _np_dtype_memo(interpreter._get_np_dtype)
            _lazy_tuple_types()
            _shared_block_types(interpreter)
            _no_discarded_overflow_checks(interpreter)
        interpreter._dcpc_threads = True  # type: ignore[attr-defined]


def _shared_block_types(interpreter: Any) -> None:
    """Triton 3.6's interpreter makes a new ``block_type`` for nearly every operation's
    result (the builder's ``get_block_ty``, ``block_type.with_element_ty``: its shape
    unwrapped and validated, its name formatted), and every ``tl.tensor`` made of one
    wraps each dimension of its shape in a new ``constexpr``: a tenth to a fifth of a
    rank's CPU under ``dcpc run`` (cProfile of gallery deepep_normal at 2x3). A block type
    is never changed once made (nothing in Triton assigns its fields), so one is kept per
    (element type, shape) and handed out again, made by the original constructor the
    first time; a tensor of a kept block type makes its shape (a ``tl.tuple`` of its own,
    as before) from the type's ``constexpr`` dimensions and numel, made once (a
    ``constexpr`` is never changed). An element type is
    told by its class, name and address space (what its ``__eq__`` compares: two equal
    ones give the same block type, equal to what either would have made)."""
    from triton.language import core

    block_type, constexpr = core.block_type, core.constexpr
    kept: dict[tuple, Any] = {}

    def shared(element_ty: Any, shape: Any) -> Any:
        try:
            key = (type(element_ty), element_ty.name,
                   getattr(element_ty, "address_space", None),
                   tuple(s.value if isinstance(s, constexpr) else s for s in shape))
            found = kept.get(key)
        except (AttributeError, TypeError):  # anything unexpected: the original, not kept
            return block_type(element_ty, shape)
        if found is None:
            found = block_type(element_ty, shape)
            found.__dict__["_dcpc_tensor_shape"] = (
                [constexpr(s) for s in found.shape], constexpr(found.numel))
            kept[key] = found
        return found

    def with_element_ty(self: Any, scalar_ty: Any) -> Any:
        return shared(scalar_ty, self.shape)

    builder = type(interpreter.interpreter_builder)
    builder.get_block_ty = lambda self, dtype, shape: shared(dtype, shape)  # type: ignore[attr-defined]
    block_type.with_element_ty = with_element_ty  # type: ignore[method-assign]
    original_init, shape_tuple = core.tensor.__init__, core.tuple
    scalar_shape = ([], constexpr(1))

    def tensor_init(self: Any, handle: Any, type: Any) -> None:  # `type`: Triton's own keyword
        made = (type.__dict__.get("_dcpc_tensor_shape") if type.is_block()
                else scalar_shape)
        if made is None:  # a block type made elsewhere (arange, splat, ...): as before
            original_init(self, handle, type)
            return
        self.handle = handle
        self.shape, self.numel = shape_tuple(made[0]), made[1]
        self.type = type
        self.dtype = type.scalar

    core.tensor.__init__ = tensor_init  # type: ignore[method-assign]

    # two blocks of one shape: nothing to broadcast (the original's answer, without its
    # walk over the dimensions in tl.tuple and constexpr comparisons)
    from triton.language.semantic import TritonSemantic

    broadcast = TritonSemantic.broadcast_impl_value

    def broadcast_impl_value(self: Any, lhs: Any, rhs: Any) -> Any:
        left, right = lhs.type, rhs.type
        if (left.is_block() and right.is_block() and type(left.shape) is shape_tuple
                and type(right.shape) is shape_tuple and left.shape.values == right.shape.values):
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    TritonSemantic.broadcast_impl_value = broadcast_impl_value  # type: ignore[method-assign]


def _lazy_tuple_types() -> None:
    """Triton 3.6's ``tl.tuple`` made its type (a ``tuple_type``, named by formatting
    every element's type) when it is made; the interpreter makes one for every tensor's
    shape, at every operation (a tenth to a fifth of a rank's CPU under ``dcpc run``), and reads
    few of their types. The type is made at its first read instead, by the same function
    from the same values (a tuple's values change only in ``_setitem``, which sets the
    type again); a type given at construction is kept as before."""
    from triton.language import core

    cls = core.tuple
    made = core._type_for_tuple_values

    def __init__(self: Any, args: Any, type: Any = None) -> None:  # `type`: Triton's own keyword
        self.values = [i for i in args]
        if isinstance(type, core.tuple_type):
            self.__dict__["_dcpc_type"] = type
        elif type is not None:  # a list of types (Triton's make_template)
            self.__dict__["_dcpc_type"] = core.tuple_type(type)

    def get_type(self: Any) -> Any:
        found = self.__dict__.get("_dcpc_type")  # not getattr: tl.tuple's __getattr__
        if found is None:
            found = self.__dict__["_dcpc_type"] = made(self.values)
        return found

    def set_type(self: Any, value: Any) -> None:
        self.__dict__["_dcpc_type"] = value

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.type = property(get_type, set_type)  # type: ignore[assignment]


def _no_discarded_overflow_checks(interpreter: Any) -> None:
    """Triton 3.6's interpreter builds, for every integer add, sub and mul narrower than
    64 bits, the int64 result and its range test (``binary_op_sanitize_overflow_impl``,
    its ``sanitize_overflow`` option on), then hands the test to ``device_assert``,
    which returns at once unless the ``debug`` option is on; the interpreter's options
    are always the defaults (debug off) and nothing reads the test: a third of a
    kernel's CPU time in the interpreter thrown away. Off while debug is off (an
    interpreter whose options turn debug on keeps it)."""
    import dataclasses

    builder = interpreter.interpreter_builder
    options = builder.options
    if not options.debug and options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _np_dtype_memo(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Triton 3.6's interpreter's ``_get_np_dtype`` (a Triton type -> the NumPy dtype
    holding it), remembered per element type: the original builds its table of 19
    dtypes at every call, and the interpreter asks at almost every operation (a tenth
    of a rank's CPU under ``dcpc run``). The answer depends on the element type alone
    (a block's is its element's, any pointer's uint64): each is the original's own,
    asked once per element type (a pointer type, not hashable, is asked every time)."""
    import triton.language as tl

    memo: dict[Any, Any] = {}

    def np_dtype(tt_dtype: Any) -> Any:
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if not isinstance(element, tl.dtype) or isinstance(element, tl.pointer_type):
            return original(tt_dtype)  # not hashable: a pointer's, anything unexpected
        found = memo.get(element)
        if found is None:
            found = memo[element] = original(element)
        return found

    np_dtype.__wrapped__ = original  # type: ignore[attr-defined]
    return np_dtype


# ---- the group, its ranks, their heap -----------------------------------------------------
class LocalGroup:
    """W ranks in this process (threads) on one device: what ``group=`` is for ``local``."""

    def __init__(self, world: int, device: str | torch.device | None = None,
                 *, timeout_s: float = 300.0):
        if world < 1:
            raise ValueError(f"LocalGroup: world must be >= 1, got {world}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.world, self.timeout_s = world, timeout_s
        if self.device.type == "cuda":
            if not torch.cuda.is_initialized():
                os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
                # more streams than hardware queues: a kernel queued behind a peer's
                # spinning kernel in a shared queue would never start (W ranks x slots)
                os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
            self.module_loading = os.environ.get("CUDA_MODULE_LOADING", "LAZY (default)")
        else:
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError("LocalGroup on CPU runs the Triton interpreter: set "
                                   "TRITON_INTERPRET=1 before triton is imported")
            _install_interpreter_threads()
            self.module_loading = "n/a (cpu)"
        self._barrier = threading.Barrier(world, timeout=timeout_s)
        self._capture_lock = threading.Lock()
        self._bases: list[int] = [0] * world
        self._keep: list[torch.Tensor] = []  # every heap's memory, for the group's life
        self._board: list[Any] = [None] * world  # LocalRank.all_gather_object
        self.ranks = [LocalRank(self, r) for r in range(world)]

    def barrier(self) -> None:
        """Every rank's thread arrives (no device sync: see ``LocalRank.barrier``)."""
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise LocalRankError("a peer rank failed or timed out; the group is broken") \
                from None

    def _make_streams(self) -> None:
        """Distinct streams for every rank, made together, once. torch hands out streams
        round robin from a pool of 32: a stream made later in a rank's thread may be a
        peer's, and a rank's kernel queued behind a peer's spinning one never starts."""
        if self.ranks[0].stream is not None:
            return
        need = self.world * (1 + EXTRA_STREAMS)
        if need > STREAM_POOL:
            raise ValueError(f"LocalGroup on CUDA: {self.world} ranks need {need} distinct "
                             f"streams, torch's pool has {STREAM_POOL} (W <= "
                             f"{STREAM_POOL // (1 + EXTRA_STREAMS)})")
        with torch.cuda.device(self.device):
            for rank in self.ranks:
                rank.stream = torch.cuda.Stream(self.device)
            for rank in self.ranks:
                rank.extra_streams = [torch.cuda.Stream(self.device)
                                      for _ in range(EXTRA_STREAMS)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            stall_s: float | None = None) -> list[Any]:
        """``fn(rank, *args)`` in one thread per rank, each on its own CUDA stream; the
        ranks' return values. A failing rank breaks the group's barrier so that the
        others stop too; ranks not done after ``timeout_s`` raise ``LocalRankHang``
        (their threads are left behind: a kernel spinning on the device cannot be
        stopped). With ``stall_s`` the ranks' progress (``LocalRank.progress``) tells a
        hang from a slow run, as the launcher does for processes (dcpc.harness.launch):
        when no rank still running said anything new for ``stall_s`` seconds of the
        progress a busy thread makes (``wall_timeout``), ``LocalRankHang`` at once;
        ranks still progressing at ``timeout_s`` raise ``LocalRankTimeout``, not a hang
        (a rank's host work, the harness's float64 reference and comparisons, may be
        slow on a busy machine while its calls advance)."""
        results: list[Any] = [None] * self.world
        errors: dict[int, str] = {}
        at_failure: list[str] = []  # the other ranks' places when the first one failed
        order: list[int] = []
        lock = threading.Lock()

        if self.device.type == "cuda":
            self._make_streams()

        def body(rank: LocalRank) -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                    with torch.cuda.stream(rank.stream):
                        results[rank.rank] = fn(rank, *args)
                else:
                    results[rank.rank] = fn(rank, *args)
            except BaseException as exc:  # noqa: BLE001 - reported below
                with lock:  # the first failure is the cause; peers then see a broken group
                    errors.setdefault(rank.rank, _brief(exc))
                    order.append(rank.rank)
                    if len(order) == 1:  # where the others were then, before they move on
                        others = [r for r, t in enumerate(threads)
                                  if r != rank.rank and t.is_alive()]
                        at_failure.append(self._where(threads, others))
                self._barrier.abort()
            finally:  # a rank that ends moved: a peer that waited on it silently is not stale
                rank.moved = time.monotonic()

        threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                    name=f"dcpc-local-rank{r.rank}") for r in self.ranks]
        start = time.monotonic()
        for rank in self.ranks:  # before the threads start: their first words count
            rank.said, rank.moved = "", start
        for t in threads:
            t.start()
        bound = timeout_s or self.timeout_s
        stalled = self._join(threads, start + bound, stall_s)  # its wall bound, or None
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        stacks = ""
        if hung:  # where each hung rank is: a kernel launch, a sync, a barrier
            stacks = self._where(threads, hung)
        now = time.monotonic()
        moving = stall_s is not None and stalled is None and any(
            now - self.ranks[r].moved < stall_s for r in hung)
        first = order[0] if order else None
        failed = f"rank {first} failed:\n{errors[first]}" if first is not None else ""
        if failed and at_failure and at_failure[0]:
            failed += (f"when rank {first} failed, the ranks still running were at:\n"
                       f"{at_failure[0]}")
        if hung and moving:
            raise LocalRankTimeout(
                f"ranks {hung} timed out after {now - start:.0f} s, still progressing (not "
                f"a hang: a larger timeout lets them finish);\n{stacks}{failed}")
        if hung or errors:
            quiet = "" if not hung or stall_s is None else (
                f", nothing new from any rank for "
                f"{now - max(r.moved for r in self.ranks):.0f} s")
            why = "at the deadline" if stalled is None else (  # which of the two stopped it
                f"at the stall bound ({stall_s:.0f} s of progress, {stalled:.0f} s wall at "
                f"the CPU share now)")
            raise (LocalRankHang if hung else LocalRankError)(
                (f"ranks {hung} did not finish within {now - start:.0f} s{quiet}, stopped "
                 f"{why}: a wait on a peer that never signalled, or kernels not "
                 f"co-resident;\n{stacks}" if hung else "") + failed)
        if self._barrier.broken:
            self._barrier.reset()
        return results

    def _where(self, threads: list[threading.Thread], ranks: list[int]) -> str:
        """Where each of ``ranks`` is now: its last words (``LocalRank.progress``), the
        CPU seconds its thread has used, and the innermost frames of its stack."""
        frames = sys._current_frames()
        out = ""
        for r in ranks:
            ident = threads[r].ident
            frame = frames.get(ident or -1)
            where = "?\n"
            if frame is not None:
                stack = traceback.extract_stack(frame)
                # deep in a library (the interpreter, numpy, a lock), also the innermost
                # frame of the caller's own code
                own = [f for f in stack[:-4]
                       if not f.filename.startswith(LIBRARY_PREFIXES)][-1:]
                if not any(f.filename.startswith(LIBRARY_PREFIXES) for f in stack[-4:]):
                    own = []
                where = "".join(traceback.format_list(own + stack[-4:]))
            said = self.ranks[r].said
            used = (thread_cpu_s(ident) if ident is not None and threads[r].is_alive()
                    else None)  # a live thread's clock only
            cpu = "" if used is None else f" its thread used {used:.2f} s of CPU so far"
            out += f"rank {r} is at{f' ({said})' if said else ''}:{cpu}\n{where}"
        return out

    def _join(self, threads: list[threading.Thread], deadline: float,
              stall_s: float | None) -> float | None:
        """Wait for ``threads`` until ``deadline``; with ``stall_s``, stop early when no
        rank still running said anything new for ``stall_s`` seconds of the progress a
        busy thread makes now (``wall_timeout``, sampled only when it may be a stall); a
        rank's end counts as its progress. When it stopped on such a stall, the wall
        seconds that bound was; None when all ended or at the deadline."""
        while True:
            alive = [r for r, t in enumerate(threads) if t.is_alive()]
            now = time.monotonic()
            if not alive or now >= deadline:
                return None
            if stall_s is not None:
                # every rank's: one that just ended moved (a peer waiting on it is not stale)
                last = max(r.moved for r in self.ranks)
                if now - last >= stall_s:
                    wall = wall_timeout(stall_s)
                    if time.monotonic() - last >= wall:
                        return wall
            threads[alive[0]].join(min(POLL_S, max(0.0, deadline - now)))


@dataclass
class LocalRank:
    """One rank of a ``LocalGroup``: pass it as ``group=`` to a generated module."""

    group: LocalGroup
    rank: int
    stream: Any = None  # its CUDA stream, set by LocalGroup.run
    # more streams of its own (a second DBO slot, a warm-up side stream): never make one
    # with torch.cuda.Stream() in a rank's thread (see LocalGroup._make_streams)
    extra_streams: list[Any] = field(default_factory=list)
    said: str = ""  # what it said last (``progress``), and when (time.monotonic)
    moved: float = 0.0

    def progress(self, text: str) -> None:
        """Record what this rank is doing now: ``LocalGroup.run(stall_s=...)`` takes a
        rank that says something new for a rank still moving, and names the last words
        of a hung one."""
        self.said, self.moved = text, time.monotonic()

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def device(self) -> torch.device:
        return self.group.device

    def barrier(self) -> None:
        """This rank's queued work is done (its stream), then every rank arrives."""
        sync_stream(self.device)
        self.group.barrier()

    def all_gather_object(self, value: Any) -> list[Any]:
        """Collective (host objects, no device work): every rank's ``value``, rank order."""
        board = self.group._board
        board[self.rank] = value
        self.group.barrier()
        got = list(board)
        self.group.barrier()  # read by all before a next call reposts
        return got

    @contextlib.contextmanager
    def capture(self, graph: Any, stream: Any = None) -> Iterator[None]:
        """Collective: capture ``graph`` on this rank, one rank after another.

        Every rank is idle first (capture synchronises the device on entry, which would
        wait for a peer's spinning kernel) and waits after, so no replay starts while
        a peer still captures."""
        self.barrier()
        with self.group._capture_lock:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                yield
        self.barrier()


class LocalThreadHeap:
    """The symmetric heap of one rank of a ``LocalGroup``: one allocation per rank on the
    shared device, every peer's address in the pointer tables."""

    def __init__(self, rank: LocalRank, device: torch.device, poison: bool = False):
        if torch.device(device).type != rank.device.type:
            raise ValueError(f"local heap: module device {device} is not the group's "
                             f"{rank.device}")
        self._rank, self.rank, self.world = rank, rank.rank, rank.world
        self.device, self.poison = torch.device(device), poison
        self._allocated = False

    def allocate(self, nbytes: list[int]) -> list[SymmetricBuffer]:
        if self._allocated:
            raise RuntimeError("allocate() is called once per heap")
        self._allocated = True
        group = self._rank.group
        offsets, total = aligned_offsets(nbytes)
        storage = torch.empty(total + ALIGN, dtype=torch.uint8, device=self.device)
        shift = (-storage.data_ptr()) % ALIGN
        base = storage[shift : shift + total]
        if self.poison:
            poison_(base)
        else:
            base.zero_()
        self.barrier()  # the previous allocation's tables are built by every rank
        group._bases[self.rank] = base.data_ptr()
        group._keep.append(storage)
        self.barrier()
        bases = list(group._bases)
        out: list[SymmetricBuffer] = [
            Segment(base[off : off + n],
                    torch.tensor([b + off for b in bases], dtype=torch.int64,
                                 device=self.device))
            for off, n in zip(offsets, nbytes, strict=True)]
        self.barrier()
        return out

    def barrier(self) -> None:
        self._rank.barrier()

    def close(self) -> None:
        """Nothing to release: the group keeps every rank's memory (a peer may still
        store into it)."""
