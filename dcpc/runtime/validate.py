"""Argument checks of generated methods: shape, dtype, device, contiguity, sizes <= max.

A ``Signature`` is built once per method at construction (it knows which run-time
size each argument dimension binds); ``bind`` runs on every call, in plain Python,
and raises ``DcpcArgumentError`` naming the method, the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dcpc.runtime import shapes
from dcpc.runtime.errors import DcpcArgumentError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
    "i32": torch.int32,
    "i64": torch.int64,
    "fp8e4m3": torch.float8_e4m3fn,
}

Param = tuple[str, tuple, str]  # (argument name, shape ASTs, dtype name)


class Signature:
    """How one method binds run-time sizes from its arguments, and checks them."""

    def __init__(
        self,
        method: str,
        params: Sequence[Param],
        env: Mapping[str, int],
        maxima: Mapping[str, int],
        device: torch.device,
    ):
        self.method, self.params, self.maxima = method, tuple(params), dict(maxima)
        self.device = device
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
        """Bind sizes from ``tensors`` into a copy of ``env``; check every argument."""
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
        return env

    def check(self, i: int, t: torch.Tensor, env: Mapping[str, int]) -> None:
        name, exprs, dtype = self.params[i]
        try:
            want = shapes.shape(exprs, env)
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
        if not t.is_contiguous():
            self._fail(i, "is not contiguous; pass a contiguous tensor (.contiguous())")

    def _fail(self, i: int, what: str) -> None:
        raise DcpcArgumentError(f"{self.method}(): argument '{self.params[i][0]}' {what}")


def check_sizes(cls_name: str, given: Mapping[str, int], known: Mapping[str, str]) -> None:
    """Constructor ``sizes=``: every name is a size of the schedule, every value an int."""
    for name, value in given.items():
        if name not in known:
            raise ValueError(
                f"{cls_name}: unknown size {name!r}; the schedule's sizes are {sorted(known)}"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{cls_name}: size {name} must be an int, got {value!r}")
