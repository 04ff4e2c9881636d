"""Argument checks of generated methods: shape, dtype, device, contiguity, sizes <= max.

A ``Signature`` is built once per method at construction (it knows which run-time
size each argument dimension binds); ``bind`` runs on every call, in plain Python,
and raises ``DcpcArgumentError`` naming the method, the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dcpc.runtime import shapes
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.tuning import TUNING_KNOBS, knob_ok

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
    "i32": torch.int32,
    "i64": torch.int64,
    "fp8e4m3": torch.float8_e4m3fn,
    "fp8e5m2": torch.float8_e5m2,
}

Param = tuple[str, tuple, str]  # (argument name, shape ASTs, dtype name)
MEMO_ENTRIES = 64  # memoised binds per method (cleared when full: sizes change rarely)
Layout = tuple[str, int, int, bool]  # (argument name, a, b, unit): see axis_strides


def axis_strides(shape: Sequence[int], stride: Sequence[int], a: int, b: int,
                 unit: bool) -> tuple[tuple[int, int, int], str | None]:
    """A tensor seen as three axes, dims [:a], [a:b], [b:]: one stride per axis, or why
    not. Within an axis, every dim must step over the next one exactly (size-1 dims do
    not count); ``unit``: the last axis must have stride 1 (a kernel's vector loads)."""
    if 0 in shape:
        return (0, 0, 0), None
    out = []
    for lo, hi in ((0, a), (a, b), (b, len(shape))):
        dims = [d for d in range(lo, hi) if shape[d] != 1]
        for x, y in zip(dims, dims[1:], strict=False):
            if stride[x] != stride[y] * shape[y]:
                return (0, 0, 0), (
                    f"has strides {tuple(stride)}: dims {x} and {y} cannot be read as one "
                    "axis (dims " + (f"{lo}..{hi - 1}" if hi - lo > 1 else f"{lo}") +
                    " must be packed with each other)")
        out.append(stride[dims[-1]] if dims else 0)
    if unit and b < len(shape) and any(shape[d] != 1 for d in range(b, len(shape))) and out[2] != 1:
        return (0, 0, 0), (f"has strides {tuple(stride)}: its last dim must be contiguous "
                           "(stride 1)")
    return (out[0], out[1], out[2]), None


class Signature:
    """How one method binds run-time sizes from its arguments, and checks them."""

    def __init__(
        self,
        method: str,
        params: Sequence[Param],
        env: Mapping[str, int],
        maxima: Mapping[str, int],
        device: torch.device,
        layouts: Sequence[Layout] = (),
        envs: dict[tuple, dict[str, int]] | None = None,
    ):
        self.method, self.params, self.maxima = method, tuple(params), dict(maxima)
        self.device = device
        index = {name: i for i, (name, _, _) in enumerate(self.params)}
        # per strided role: (param index, a, b, unit); strides[k] is set by every bind
        self.layouts = tuple((index[name], a, b, unit) for name, a, b, unit in layouts)
        self.strided = frozenset(i for i, *_ in self.layouts)
        self.strides: list[tuple[int, int, int]] = [(0, 0, 0)] * len(self.layouts)
        self._memo: dict[Any, tuple[dict[str, int], dict[str, int], list]] = {}
        self.envs = {} if envs is None else envs  # shared by the module's methods
        self.dtypes = tuple(DTYPES[dtype] for _, _, dtype in params)
        # (param index, dim index, size, a, b): size = (shape[dim] - b) / a
        self.binders: list[tuple[int, int, str, int, int]] = []
        bound = set(env)
        for i, (_, exprs, _) in enumerate(params):
            for d, expr in enumerate(exprs):
                free = shapes.symbols(expr) - bound
                if len(free) != 1:
                    continue
                (name,) = free
                if name not in self.maxima:
                    continue
                probe = {k: v for k, v in env.items() if k != name}
                lin = shapes.linear_in(expr, name, probe)
                if lin is not None:
                    self.binders.append((i, d, name, *lin))
                    bound.add(name)

    def bind(self, tensors: Sequence[torch.Tensor], env: dict[str, int]) -> dict[str, int]:
        """Bind sizes from ``tensors`` into a copy of ``env``; check every argument.

        Memoised: a call whose arguments have the shapes, strides, dtypes and devices of
        an earlier one, from the same ``env`` object (a slot's env after the previous
        step, itself memoised), returns that call's env and strides without checking
        again (what was checked is exactly what the key holds). Engines repeat the same
        sizes every step, so the eager host path pays the checks once per size."""
        try:
            key = (id(env), tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors))
        except (AttributeError, TypeError):  # not tensors: the checks below say what
            key = None
        hit = self._memo.get(key) if key is not None else None
        if hit is not None and hit[0] is env:  # the same env object, not a reused id
            self.strides[:] = hit[2]
            return hit[1]
        out = self._bind(tensors, env)
        # one object per distinct env: the next step's memo key (its id) then repeats
        out = self.envs.setdefault(tuple(sorted(out.items())), out)
        if key is not None:
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = (env, out, list(self.strides))
        return out

    def _bind(self, tensors: Sequence[torch.Tensor], env: dict[str, int]) -> dict[str, int]:
        env = dict(env)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                self._fail(i, f"is a {type(t).__name__}, expected a torch.Tensor")
        for i, d, name, a, b in self.binders:
            t = tensors[i]
            if t.dim() <= d:
                self._fail(i, f"has {t.dim()} dimensions, expected {len(self.params[i][1])}")
            x, rem = divmod(t.shape[d] - b, a)
            if rem or not 0 <= x <= self.maxima[name]:
                what = shapes.unparse(self.params[i][1][d])
                self._fail(
                    i,
                    f"has size {t.shape[d]} in dimension {d} ({what}), which gives "
                    f"{name} outside 0..{self.maxima[name]} (the max this module was built for)",
                )
            env[name] = x
        for i, t in enumerate(tensors):
            self.check(i, t, env)
        for k, (i, a, b, unit) in enumerate(self.layouts):
            t = tensors[i]
            strides, why = axis_strides(t.shape, t.stride(), a, b, unit)
            if why is not None:
                self._fail(i, why + "; pass a view whose rows are strided only, or .contiguous()")
            self.strides[k] = strides
        return env

    def check(self, i: int, t: torch.Tensor, env: Mapping[str, int]) -> None:
        name, exprs, dtype = self.params[i]
        try:
            want = expected_shape(self.method, name, exprs, env)
        except KeyError as exc:
            raise DcpcArgumentError(
                f"{self.method}(): size {exc.args[0]} of argument '{name}' is not bound yet; "
                f"pass sizes={{'{exc.args[0]}': ...}} or call a step that binds it first"
            ) from None
        if tuple(t.shape) != want:
            dims = ", ".join(shapes.unparse(e) for e in exprs)
            self._fail(i, f"has shape {tuple(t.shape)}, expected {want} = [{dims}]")
        if t.dtype != self.dtypes[i]:
            self._fail(i, f"has dtype {t.dtype}, expected {self.dtypes[i]} ({dtype})")
        if t.device.type != self.device.type or (
            self.device.index is not None and t.device.index != self.device.index
        ):
            self._fail(i, f"is on {t.device}, expected {self.device}")
        if i not in self.strided and not t.is_contiguous():
            self._fail(i, "is not contiguous; pass a contiguous tensor (.contiguous())")

    def _fail(self, i: int, what: str) -> None:
        raise DcpcArgumentError(f"{self.method}(): argument '{self.params[i][0]}' {what}")


def expected_shape(method: str, name: str, exprs: Sequence[Any], env: Mapping[str, int]
                   ) -> tuple[int, ...]:
    """The shape argument ``name`` must have for the sizes ``env`` (bound from this
    call's arguments): DcpcArgumentError naming the argument and the dimension when a
    dimension is not a whole number or is negative there (``dcpc check`` proves the
    dimensions for sizes 1..max; a call binds 0..max). KeyError: a size not bound."""
    out = []
    for d, expr in enumerate(exprs):
        try:
            value = shapes.evaluate(expr, env)
        except ValueError as exc:
            raise DcpcArgumentError(
                f"{method}(): dimension {d} of argument '{name}' cannot be sized for "
                f"{_sizes(expr, env)}: {exc}") from None
        if value < 0:
            raise DcpcArgumentError(
                f"{method}(): dimension {d} of argument '{name}' ({shapes.unparse(expr)}) "
                f"is {value} for {_sizes(expr, env)}; the sizes bound from this call's "
                "arguments give no valid shape")
        out.append(value)
    return tuple(out)


def _sizes(expr: Any, env: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={env[k]}" for k in sorted(shapes.symbols(expr)) if k in env)


def check_sizes(cls_name: str, given: object, known: Mapping[str, str]) -> dict[str, int]:
    """Constructor ``sizes=``: a mapping of the schedule's size names to ints."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise DcpcArgumentError(
            f"{cls_name}: sizes must be a dict of size names to ints, e.g. "
            f"{{'{next(iter(sorted(known)), 'T')}': 8}}, got {given!r}"
        )
    for name, value in given.items():
        if name not in known:
            raise DcpcArgumentError(
                f"{cls_name}: unknown size {name!r}; the schedule's sizes are {sorted(known)}"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise DcpcArgumentError(f"{cls_name}: size {name} must be an int, got {value!r}")
    return dict(given)


BACKENDS = ("auto", "symm_mem", "host", "torch", "local")


def check_device(cls_name: str, device: object, backend: object) -> torch.device:
    """Constructor ``device=`` (None: the current CUDA device, else the CPU) and whether
    ``backend=`` can run there. Only ``cpu`` and an existing ``cuda:i`` are devices."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise DcpcArgumentError(
            f"{cls_name}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise DcpcArgumentError(
            f"{cls_name}: device must be 'cpu', 'cuda', 'cuda:<index>' or a torch.device, "
            f"got {device!r}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise DcpcArgumentError(
            f"{cls_name}: device {device!r} is not a device; use 'cpu' or 'cuda[:<index>]'"
        ) from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise DcpcArgumentError(
                f"{cls_name}: device {dev} does not exist; the CPU is device 'cpu' (no index)"
            )
        dev = torch.device("cpu")
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DcpcArgumentError(
                f"{cls_name}: device {dev}: CUDA is not available on this machine; use "
                "device='cpu' (backend 'host' or 'torch')"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < count:
            raise DcpcArgumentError(
                f"{cls_name}: device {dev} does not exist; this machine has cuda:0..cuda:"
                f"{count - 1}"
            )
        dev = torch.device("cuda", index)
    else:
        raise DcpcArgumentError(
            f"{cls_name}: device {dev} is not supported; generated modules run on 'cpu' "
            "(backends host, torch) or 'cuda[:<index>]' (symm_mem, torch)"
        )
    if backend == "symm_mem" and dev.type != "cuda":
        raise DcpcArgumentError(
            f"{cls_name}: backend 'symm_mem' needs a CUDA device, got {dev}; on CPU use "
            "backend 'host' (ranks on one machine, Triton interpreter) or 'torch' (gloo)"
        )
    if backend == "host" and dev.type != "cpu":
        raise DcpcArgumentError(
            f"{cls_name}: backend 'host' runs on the CPU, got device {dev}; on CUDA use "
            "'symm_mem' or 'torch'"
        )
    return dev


def check_number(cls_name: str, name: str, value: object, low: float, high: float,
                 kind: type = int) -> None:
    """An int (or, with ``kind=float``, a real number) in ``low..high``; never a bool."""
    ok_type = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, ok_type) or not low <= value <= high:
        what = "a number" if kind is float else "an int"
        raise DcpcArgumentError(f"{cls_name}: {name} must be {what} in {low:g}..{high:g}, "
                                f"got {value!r}")


def check_tuning(cls_name: str, tuning: object, steps: Mapping[str, object]) -> dict:
    """Constructor ``tuning=``: {step: {knob: int}} with known steps and knobs."""
    if tuning is None:
        return {}
    if not isinstance(tuning, Mapping):
        raise DcpcArgumentError(f"{cls_name}: tuning must be a dict {{step: {{knob: int}}}}, "
                                f"got {tuning!r}")
    for step, knobs in tuning.items():
        if step not in steps:
            raise DcpcArgumentError(f"{cls_name}: tuning for unknown step {step!r}; the "
                                    f"steps with kernels are {sorted(steps)}")
        if not isinstance(knobs, Mapping):
            raise DcpcArgumentError(f"{cls_name}: tuning[{step!r}] must be a dict of knobs "
                                    f"({', '.join(TUNING_KNOBS)}), got {knobs!r}")
        for knob, value in knobs.items():
            if knob not in TUNING_KNOBS:
                raise DcpcArgumentError(f"{cls_name}: tuning[{step!r}] has unknown knob "
                                        f"{knob!r}; the knobs are {', '.join(TUNING_KNOBS)}")
            check_knob(cls_name, f"tuning[{step!r}][{knob!r}]", knob, value)
    return {step: dict(knobs) for step, knobs in tuning.items()}


def check_knob(cls_name: str, where: str, knob: str, value: object) -> None:
    if not knob_ok(knob, value):
        what, allowed = TUNING_KNOBS[knob].split(", ", 1)
        raise DcpcArgumentError(f"{cls_name}: {where} must be {allowed} ({what}), got {value!r}")
