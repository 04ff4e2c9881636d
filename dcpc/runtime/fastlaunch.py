"""The eager host path of a generated kernel's launch: Triton's dispatch once per key,
then the compiled kernel's launcher directly.

Engines run DCP outside CUDA graphs for mixed batches, where the host is the bottleneck.
Triton's ``JITFunction.run`` rebuilds the specialisation of every argument, the options
and the cache key on every launch (about 12 us for a one-argument kernel on an H200's
host). A generated method launches the same kernel with the same kinds of arguments
again and again, so ``fast_launch`` keys a launch by what Triton specialises on (every
int by value, every tensor by dtype and 16-byte alignment, every constexpr, the grid and
the device) and, on a repeat, calls the compiled kernel's launcher with the same
argument list Triton would pass it (positional arguments, then the constexprs in the
kernel's order). The first launch of a key, a launch inside ``local.compile_only`` (the
warm-up), a launch with a profiler's launch hook set and the Triton interpreter (CPU)
take Triton's own path. A generated method's call plan (dcpc.runtime.calls) launches
through ``FastKernel.replay``, keyed only by what its call key leaves open: the engine
tensors' alignment and type, and the device.

What a repeat launch skips that Triton's path does every time: re-reading
``knobs.runtime.debug`` and ``knobs.compilation.instrumentation_mode`` (turning either on
after the first launch keeps the kernel compiled without it), the check that the
kernel's global variables have not changed, and ``pre_run_hooks``; generated kernels
use none of them.

On by default; ``DCPC_FAST_LAUNCH=0`` (read when a module is imported) takes Triton's
path for every launch. Checked on one H200 at 1d32504 (benchmarks/results/
one_gpu_1d32504.md): the whole one-GPU suite with it, W = 2, 4 and 8, every correctness,
CUDA-graph and DBO check that ran clean, and the engine adapters' tests; 18-22 us of
host time per eager call against 28-36 us through Triton's path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from dcpc.runtime import calls

MAX_KEYS = 1024  # launches remembered per kernel (cleared when full: sizes change rarely)


VERIFIED_TRITON = ("3.6.",)  # the launcher convention this path calls was read and run here


def _enabled() -> bool:
    """On unless DCPC_FAST_LAUNCH=0, the interpreter runs, or Triton is not a version
    whose launcher convention was checked (another takes Triton's own path)."""
    import triton

    return (os.environ.get("DCPC_FAST_LAUNCH", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and triton.__version__.startswith(VERIFIED_TRITON))


_TENSOR = torch.Tensor


def _arg_key(args: tuple) -> tuple:
    """What Triton specialises an argument list on: ints by value (covers == 1, % 16 and
    the int32/int64 choice), tensors by dtype and data_ptr % 16, anything else by value
    (a tensor subclass, a bool or a float by its type too)."""
    return tuple([
        a if type(a) is int
        else (a.dtype, a.data_ptr() & 15 == 0) if type(a) is _TENSOR
        else (type(a), a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, _TENSOR)
        else (type(a), a)
        for a in args
    ])


class FastKernel:
    """A launched ``@triton.jit`` kernel: ``kernel[grid](*args, **constexprs)`` as with
    Triton, through a per-key cache of the compiled kernel (see the module docstring)."""

    def __init__(self, fn: Any):
        self.fn = fn
        self._cache: dict[tuple, tuple[Any, tuple]] = {}
        self._names: tuple[str, ...] = tuple(getattr(fn, "arg_names", ()))
        self._on = _enabled() and bool(self._names)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getattr__(self, name: str) -> Any:  # the JITFunction's own attributes
        return getattr(self.fn, name)

    def __getitem__(self, grid: tuple) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.note((self, grid, args, kwargs))  # a method's call plan replays it
            return self.launch(grid, args, kwargs)

        return run

    def launch(self, grid: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not self._on or _slow_now():
            return self.fn[grid](*args, **kwargs)
        driver = _triton()[1].active
        device = driver.get_current_device()
        # the constexprs and options by name and type too: BLOCK=1 is not BLOCK=1.0, and
        # (BLOCK=4, MASK=8) is not (MASK=4, BLOCK=8)
        key = (grid, device, _arg_key(args), tuple(kwargs), _arg_key(tuple(kwargs.values())))
        hit = self._cache.get(key)
        if hit is None:
            compiled = self.fn[grid](*args, **kwargs)  # compiles or finds it, and launches
            self._remember(key, compiled, len(args), kwargs)
            return compiled
        compiled, tail = hit
        stream = driver.get_current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *tail)
        return compiled

    def replay(self, launch: Any, args: Sequence[Any]) -> None:
        """A call plan's launch (dcpc.runtime.calls.Launch), ``args`` holding this call's
        engine tensors at ``launch.subs``. The plan's key fixed every other argument and
        those tensors' dtypes, so what Triton specialises on can differ only in their
        type and 16-byte alignment and in the current device: the key here."""
        if not self._on or _slow_now():
            self.launch(launch.grid, args, launch.kwargs)
            return
        driver = _triton()[1].active
        device = driver.get_current_device()
        key = (device, *[(type(args[i]), args[i].data_ptr() & 15 == 0) for i, _ in launch.subs])
        hit = launch.compiled.get(key)
        if hit is None:  # this kernel's own cache, or Triton's path on its first launch
            compiled = self.launch(launch.grid, args, launch.kwargs)
            tail = self._tail(compiled, len(args), launch.kwargs)
            if tail is not None:
                if len(launch.compiled) >= MAX_KEYS:
                    launch.compiled.clear()
                launch.compiled[key] = (compiled, tail)
            return
        compiled, tail = hit
        grid = launch.grid
        stream = driver.get_current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *tail)

    def _tail(self, compiled: Any, positional: int, kwargs: dict[str, Any]) -> tuple | None:
        """The constexprs in the kernel's parameter order (what follows the positional
        arguments in the launcher's call); None when the launch is not one this path can
        repeat exactly."""
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return None
        rest = self._names[positional:]
        if any(name not in kwargs for name in rest):
            return None  # a defaulted parameter: Triton's path fills it in
        return tuple(kwargs[name] for name in rest)

    def _remember(self, key: tuple, compiled: Any, positional: int,
                  kwargs: dict[str, Any]) -> None:
        """Keep the compiled kernel and the constexprs in the kernel's parameter order;
        nothing when the launch is not one this path can repeat exactly."""
        tail = self._tail(compiled, positional, kwargs)
        if tail is None:
            return
        if len(self._cache) >= MAX_KEYS:
            self._cache.clear()
        self._cache[key] = (compiled, tail)


_MODULES: list[Any] = []  # (triton.knobs, triton's driver, dcpc.runtime.local), imported once


def _triton() -> list[Any]:
    if not _MODULES:  # ranks as threads may get here at once: one assignment, no extend
        from triton import knobs
        from triton.runtime.driver import driver

        from dcpc.runtime import local

        _MODULES[:] = [knobs, driver, local]
    return _MODULES


def _hooked(hook: Any) -> bool:
    """A launch hook is set: Triton 3.6 keeps a ``HookChain`` (never None; hooked when
    its ``calls`` are not empty), older Triton a callable or None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _slow_now() -> bool:
    """Take Triton's path: the local backend's warm-up (compile and load, launch nothing)
    or a launch hook (a profiler) is active."""
    knobs, _, local = _MODULES or _triton()
    runtime = knobs.runtime
    return (local._tls.compile_only or _hooked(runtime.launch_enter_hook)
            or _hooked(runtime.launch_exit_hook))


def fast_launch(fn: Any) -> Any:
    """Decorator of a generated module's launched kernels (above ``@triton.jit``)."""
    return FastKernel(fn)
