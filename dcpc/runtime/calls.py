"""The eager host fast path of generated methods: a call plan per call key, replayed.

A generated method's first call with a given key runs its checked path (argument
checks, size binding, the guard's fingerprint, scalars, grid, views) and records what
that path did to launch: the kernels it launched with their grids and argument lists,
and the outputs it poisoned. A later call with the same key replays the record: the
guard's call order, the fingerprint, the slot's sizes, the watchdog, the launches (the
call's own engine tensors put in place of the recorded ones), the error check, the
returned views. No argument check is skipped for a key it was not run for.

The key is everything the checked path's result depends on: the method, the slot (and
its type: True is not slot 1), and
each engine tensor's shape, strides, dtype and device; a plan also holds the slot's
sizes it was made from (an object of the module's interned sizes; see
``validate.Signature.bind``) and replays only from the same object. Not in the key: the
tensors' data pointers, which the launch reads from the tensors passed (and the fast
launcher keys by alignment, dcpc.runtime.fastlaunch). A call with ``sizes=`` always
takes the checked path.

A record is kept only when every tensor it launched with is either one of the call's
engine tensors (each a distinct object) or a tensor the module owns for its lifetime;
anything else (a view made during the call, a Python object that is not an int, float,
bool or string) leaves the method on its checked path for that key.

A plan holds what the instance fixed at construction (tuning, rank, the guard switch,
buffers): code that changes those afterwards (benchmarks/tune_gpu.py changes
``_tune``) must clear ``_plans``.

``COUNTS`` counts, per process: plans made for a call key that had none (``plans``: a
new shape, whose launches may meet Triton specialisations not compiled yet), plans
remade for a key that had one made from other sizes (``replans``: a call after a call
of another token count; host work only, the kernels' specialisations are those of the
key's first plan), module instances whose buffers were allocated (``allocations``)
and, counted by dcpc.engines.common's module cache, schedules compiled (``compiles``)
and module files imported (``imports``). Inside a CUDA-graph capture only ``replans``
may grow: dcpc.engines.capture's warm-up is tested by them
(tests/engines/test_engines_capture.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.guard import enter, leave
from dcpc.runtime.heap import poison_

MAX_PLANS = 4096  # plans per module instance (cleared when full: sizes change rarely)
_tls = threading.local()  # the record being made on this thread (ranks can be threads)
_SCALARS = (int, float, bool, str, type(None))
NOT_A_KEY = (AttributeError, TypeError)  # what building a call key raises for non-tensors
COUNTS = {"plans": 0, "replans": 0, "allocations": 0, "compiles": 0, "imports": 0}
_counts_lock = threading.Lock()  # ranks as threads count at once


def count(what: str) -> None:
    """One more ``what`` in COUNTS (see the module docstring)."""
    with _counts_lock:
        COUNTS[what] += 1


def counts() -> dict[str, int]:
    """A copy of COUNTS now (subtract two of them to count what happened between)."""
    with _counts_lock:
        return dict(COUNTS)


@dataclass(frozen=True, slots=True)
class Launch:
    """One recorded launch: ``kernel[grid](*args, **kwargs)`` with the call's engine
    tensor ``k`` at argument position ``i`` for each ``(i, k)`` in ``subs``; replayed by
    ``kernel.replay`` (dcpc.runtime.fastlaunch.FastKernel)."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict[str, Any]
    subs: tuple[tuple[int, int], ...]
    fp_at: int | None = None  # where the call's fingerprint goes (not specialised on)
    compiled: dict = field(default_factory=dict)  # the fast launcher's (FastKernel.replay)


@dataclass(frozen=True, slots=True)
class CallPlan:
    """What a repeat call does (see the module docstring)."""

    method: str
    index: int  # the step's index (the error check names it)
    env_in: dict[str, int]  # the slot's sizes this plan was made from (identity)
    env: dict[str, int]  # the slot's sizes after the call
    fp: int  # the call's fingerprint (the guard)
    arm: bool  # arm the watchdog (CPU, W > 1)
    actions: tuple[Launch | torch.Tensor, ...]  # in order: a launch, or an output to poison
    returns: Any


def note(action: Any) -> None:
    """Add a launch ``(kernel, grid, args, kwargs)`` or a poisoned tensor to the record
    being made on this thread, if any (FastKernel and ScheduleModule._poison_output)."""
    record = getattr(_tls, "record", None)
    if record is not None:
        record.append(action)


def start() -> None:
    _tls.record = []


def stop() -> list[Any]:
    record, _tls.record = getattr(_tls, "record", None), None
    return record or []


def launches(record: list[Any], tensors: tuple[torch.Tensor, ...],
             owned: dict[int, torch.Tensor]) -> tuple[Launch | torch.Tensor, ...] | None:
    """The replayable form of ``record``, or None when it cannot be replayed exactly."""
    engine = {id(t): k for k, t in enumerate(tensors)}
    if len(engine) != len(tensors):
        return None  # one tensor passed twice: its positions could not be told apart
    out: list[Launch | torch.Tensor] = []
    for action in record:
        if isinstance(action, torch.Tensor):
            if owned.get(id(action)) is not action:
                return None
            out.append(action)
            continue
        kernel, grid, args, kwargs = action
        subs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                k = engine.get(id(a))
                if k is not None and tensors[k] is a:
                    subs.append((i, k))
                elif owned.get(id(a)) is not a:
                    return None
            elif not isinstance(a, _SCALARS):
                return None
        if not all(isinstance(v, _SCALARS) for v in kwargs.values()):
            return None
        if not all(type(g) is int for g in grid):
            return None
        args = tuple(None if any(i == j for j, _ in subs) else a for i, a in enumerate(args))
        names = tuple(getattr(kernel, "arg_names", ()))[: len(args)]
        fp_at = names.index("fingerprint") if "fingerprint" in names else None
        out.append(Launch(kernel, tuple(grid), args, dict(kwargs), tuple(subs), fp_at))
    return tuple(out)


class CallPlans:
    """The fast path's half of ``ScheduleModule``: ``_record`` (a call's first run per
    key) and ``_replay`` (every later one). The generated methods build the key."""

    _plans: dict[tuple, CallPlan]
    _fast: bool  # plans are made and replayed (every backend but torch)
    _owned_tensors: dict[int, torch.Tensor]  # see _owned
    # what the fast path reads of ScheduleModule (dcpc.runtime.module)
    _env: list[dict[str, int]]
    _fp: int
    _fp_base: int  # _fp before the call's call_id (module._bind)
    _call_ids: int  # call ids enter the fingerprint modulo this (module.CALL_IDS)
    _with_call_id: Callable[[str, Any, int], int]
    _guard: bool
    _failed: BaseException | None
    _heap: Any
    _order: Any
    _watchdog: Any
    _arms: set[str]
    _local: dict[str, list[torch.Tensor]]
    _peers: dict[str, list[Any]]
    _bank: Any
    _check_each_call: bool
    _check: Callable[[int], None]
    _fail: Callable[[BaseException], None]
    _unusable: Callable[[str], BaseException]
    PUTS: dict[str, str]
    _split_sizes: Callable[[str, int, Any], None]

    def _owned(self) -> dict[int, torch.Tensor]:
        """The tensors this instance holds for its lifetime (by id), which a plan may keep.
        Called once per instance, right after its buffers are allocated (module.__init__):
        counted as ``allocations``."""
        count("allocations")
        out: dict[int, torch.Tensor] = {}
        bank = [v for v in vars(self._bank).values() if isinstance(v, torch.Tensor)]
        groups = [*self._local.values(), *self._peers.values(), bank]
        for tensors in groups:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    out[id(t)] = t
        return out

    def _record(self, key: tuple, method: str, index: int, body: Any,
                tensors: tuple, slot: int, call_id: int | None = None) -> Any:
        """Run ``body`` (the method's checked path) and keep its record as ``key``'s plan
        (with the fingerprint before ``call_id``: a replay adds its own call's id)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(self._env):
            return body(*tensors, slot=slot, sizes=None, call_id=call_id)  # it says what is wrong
        env_in = self._env[slot]
        start()
        try:
            out = body(*tensors, slot=slot, sizes=None, call_id=call_id)
        finally:
            record = stop()
        actions = launches(record, tensors, self._owned_tensors)
        if actions is not None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            count("replans" if key in self._plans else "plans")
            self._plans[key] = CallPlan(
                method, index, env_in, self._env[slot], self._fp_base,
                method in self._arms, actions, out,
            )
        return out

    def _replay(self, plan: CallPlan, slot: int, tensors: tuple,
                call_id: int | None = None) -> Any:
        """A repeat call: what ``_record`` saw the checked path do, with these tensors.
        One call at a time and an error fails the instance, as ``guard.guarded`` does on
        the checked path (``guard.enter``/``leave``)."""
        enter(self, plan.method, slot)
        try:
            if self._failed is not None or self._heap is None:
                raise self._unusable(plan.method)
            if call_id is not None and (type(call_id) is not int):
                raise DcpcArgumentError(
                    f"{plan.method}(): call_id must be an int, got {call_id!r}")
            if self._guard:
                self._order.enter(plan.method, slot)
                self._fp = plan.fp
                if call_id is not None and call_id % self._call_ids:
                    self._fp = self._with_call_id(plan.method, plan.env,
                                                  call_id % self._call_ids)
            self._env[slot] = plan.env
            if self.PUTS:
                self._split_sizes(plan.method, slot, plan.env)
            if plan.arm:
                self._watchdog.arm()
            for action in plan.actions:
                if type(action) is Launch:
                    args = action.args
                    if action.subs or action.fp_at is not None:
                        args = list(args)
                        for i, k in action.subs:
                            args[i] = tensors[k]
                        if action.fp_at is not None:  # this call's (its call_id's)
                            args[action.fp_at] = self._fp
                    action.kernel.replay(action, args)
                else:
                    poison_(action)
            if self._watchdog is not None or self._check_each_call:
                self._check(plan.index)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            leave(self)
        return plan.returns
