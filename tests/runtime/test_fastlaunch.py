"""dcpc.runtime.fastlaunch's cache logic. The compiled path needs CUDA (the one-GPU suite
runs every generated kernel through it); here a stand-in for Triton's JITFunction and
CompiledKernel records what the fast path would hand the launcher, since Triton's
compiled launcher does not exist on CPU."""

from __future__ import annotations

from typing import Any

import torch

from dcpc.runtime import fastlaunch


class Compiled:
    packed_metadata = "meta"
    function = "fn-handle"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, gx: int, gy: int, gz: int, stream: Any, function: Any, meta: Any, *rest: Any
            ) -> None:
        self.log.append(("fast", (gx, gy, gz), rest[3:]))  # after launch_metadata, 2 hooks


class Jit:
    """What FastKernel uses of a JITFunction: arg_names and kernel[grid](...)."""

    arg_names = ["x", "n", "BLOCK", "MASK"]

    def __init__(self) -> None:
        self.log: list = []
        self.compiled = Compiled(self.log)

    def __getitem__(self, grid: tuple) -> Any:
        def run(*args: Any, **kwargs: Any) -> Compiled:
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled
        return run


def _kernel(monkeypatch: Any) -> tuple[fastlaunch.FastKernel, Jit]:
    class Driver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 7

    class Active:
        active = Driver()

    from triton import knobs  # the real one: Triton 3.6's hooks are HookChains, never None

    from dcpc.runtime import local

    monkeypatch.setattr(fastlaunch, "_MODULES", [knobs, Active(), local])
    jit = Jit()
    k = fastlaunch.FastKernel(jit)
    k._on = True  # what CUDA without TRITON_INTERPRET gives (DCPC_FAST_LAUNCH unset or 1)
    return k, jit


def test_repeat_launches_skip_triton_and_pass_constexprs_in_order(monkeypatch) -> None:
    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    k[(3,)](x, 5, MASK=True, BLOCK=16)
    k[(3,)](x, 5, MASK=True, BLOCK=16)
    assert [e[0] for e in jit.log] == ["triton", "fast"]
    assert jit.log[1][1] == (3, 1, 1)
    assert jit.log[1][2] == (x, 5, 16, True)  # positional, then BLOCK, MASK by name order


def test_what_triton_specialises_on_changes_the_key(monkeypatch) -> None:
    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    calls = [((x, 5), {"BLOCK": 16, "MASK": True}),
             ((x, 1), {"BLOCK": 16, "MASK": True}),  # an int equal to 1
             ((x, 5), {"BLOCK": 32, "MASK": True}),  # a constexpr
             ((x[1:], 5), {"BLOCK": 16, "MASK": True}),  # not 16-byte aligned
             ((x.double(), 5), {"BLOCK": 16, "MASK": True}),  # another dtype
             ((x + 1, 5), {"BLOCK": 16, "MASK": True})]  # a new tensor, same kind: fast
    for args, kwargs in calls:
        k[(2,)](*args, **kwargs)
    assert [e[0] for e in jit.log] == ["triton"] * 5 + ["fast"]


def test_warm_up_never_launches_through_the_fast_path(monkeypatch) -> None:
    from dcpc.runtime import local

    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    k[(1,)](x, 5, BLOCK=16, MASK=False)
    monkeypatch.setattr(local._tls, "compile_only", True, raising=False)
    k[(1,)](x, 5, BLOCK=16, MASK=False)
    assert [e[0] for e in jit.log] == ["triton", "triton"]


def test_a_launch_hook_takes_tritons_path(monkeypatch) -> None:
    """A profiler's hook (Triton 3.6: added to a HookChain) must see every launch."""
    from triton import knobs

    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    k[(1,)](x, 5, BLOCK=16, MASK=False)
    k[(1,)](x, 5, BLOCK=16, MASK=False)  # fast: no hook
    seen: list = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        k[(1,)](x, 5, BLOCK=16, MASK=False)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert [e[0] for e in jit.log] == ["triton", "fast", "triton"]


def test_the_fast_path_is_the_default_off_by_switch_and_never_under_the_interpreter(
        monkeypatch) -> None:
    monkeypatch.delenv("DCPC_FAST_LAUNCH", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "")
    assert fastlaunch.FastKernel(Jit())._on  # on by default
    monkeypatch.setenv("DCPC_FAST_LAUNCH", "0")
    assert not fastlaunch.FastKernel(Jit())._on
    monkeypatch.setenv("DCPC_FAST_LAUNCH", "1")
    assert fastlaunch.FastKernel(Jit())._on
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    jit = Jit()
    k = fastlaunch.FastKernel(jit)
    x = torch.zeros(4)
    for _ in range(2):
        k[(1,)](x, 5, BLOCK=16, MASK=False)
    assert [e[0] for e in jit.log] == ["triton", "triton"]


def test_constexprs_are_keyed_by_name_and_type(monkeypatch) -> None:
    """Triton compiles anew for BLOCK=1.0 vs BLOCK=1, and for swapped constexpr values:
    the fast path must not reuse the first call's kernel for them."""
    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    k[(1,)](x, 5, BLOCK=4, MASK=8)
    k[(1,)](x, 5, MASK=4, BLOCK=8)  # same values, other names: a new key
    k[(1,)](x, 5, BLOCK=1, MASK=True)
    k[(1,)](x, 5, BLOCK=1.0, MASK=1)  # equal values, other types: a new key
    k[(1,)](x, 5, BLOCK=1, MASK=True)  # a repeat: fast
    assert [e[0] for e in jit.log] == ["triton"] * 4 + ["fast"]


def test_only_a_checked_triton_takes_the_fast_path(monkeypatch) -> None:
    import triton

    monkeypatch.delenv("DCPC_FAST_LAUNCH", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "")
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    assert not fastlaunch.FastKernel(Jit())._on
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert fastlaunch.FastKernel(Jit())._on


def _planned(k: fastlaunch.FastKernel, engine: torch.Tensor) -> Any:
    """A call plan's launch of ``k`` (dcpc.runtime.calls): ``engine`` is the call's tensor."""
    from dcpc.runtime import calls

    calls.start()
    k[(4,)](engine, 5, MASK=True, BLOCK=16)
    (launch,) = calls.launches(calls.stop(), (engine,), {})
    return launch


def test_a_call_plans_launch_is_keyed_by_its_tensors_alignment_and_the_device(
        monkeypatch) -> None:
    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    launch = _planned(k, x)  # Triton's path (the checked call)
    y = torch.zeros(64)
    k.replay(launch, [y, 5])  # the kernel's own cache: fast, and the plan keeps it
    k.replay(launch, [x + 2, 5])  # the plan's own key
    assert [e[0] for e in jit.log] == ["triton", "fast", "fast"]
    assert jit.log[1][2] == (y, 5, 16, True) and jit.log[1][1] == (4, 1, 1)
    assert launch.compiled  # the second replay came from the plan, not FastKernel's cache
    k._cache.clear()
    z = torch.zeros(65)[1:]  # not 16-byte aligned: Triton's path, then its own entry
    k.replay(launch, [z, 5])
    k.replay(launch, [z, 5])
    assert [e[0] for e in jit.log][3:] == ["triton", "fast"]
    assert jit.log[-1][2][0] is z
    assert len(launch.compiled) == 2


def test_a_call_plans_launch_sees_the_device_and_a_launch_hook(monkeypatch) -> None:
    from triton import knobs

    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    launch = _planned(k, x)
    k.replay(launch, [x, 5])
    device = [1]
    monkeypatch.setattr(fastlaunch._MODULES[1].active, "get_current_device",
                        lambda: device[0], raising=False)
    k.replay(launch, [x, 5])  # another device: Triton's path first
    seen: list = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        k.replay(launch, [x, 5])
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert [e[0] for e in jit.log] == ["triton", "fast", "triton", "triton"]


def test_a_call_plans_launch_takes_tritons_path_when_the_fast_path_is_off(monkeypatch) -> None:
    k, jit = _kernel(monkeypatch)
    x = torch.zeros(64)
    launch = _planned(k, x)
    k._on = False  # DCPC_FAST_LAUNCH=0, the interpreter, another Triton
    k.replay(launch, [x, 5])
    k.replay(launch, [x, 5])
    assert [e[0] for e in jit.log] == ["triton"] * 3 and not launch.compiled
