"""Load the generated modules and call their steps by schedule buffer name.

A step method's arguments are the engine-owned buffers it reads, named after the
schedule's buffers (docs/internals.md); this file binds them from a dict by name, so a
change of argument order in the generator does not silently swap tensors. What each step
writes (and so what it returns, in order) is listed in ``benchmarks.support.steps``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.support.steps import STEPS


def load_class(modules_dir: Path, schedule: str) -> type:
    """Import ``<modules_dir>/<schedule>.py`` and return its schedule class."""
    path = Path(modules_dir) / f"{schedule}.py"
    if not path.exists():
        raise FileNotFoundError(f"no generated module {path}")
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:  # generated code does `from dcpc import runtime`
        sys.path.insert(0, repo)
    from dcpc.runtime.loading import import_file, schedule_class

    return schedule_class(import_file(path, f"dcpc_generated_{schedule}"), schedule)


def instantiate(cls: type, group: Any, sizes: dict[str, int], device: torch.device,
                backend: str, programs: int | None = None,
                extra: dict[str, Any] | None = None) -> Any:
    """Construct a module instance; retry with the schedule maxima if the sizes are refused."""
    tries = [sizes]
    if "H" in sizes:
        tries.append({**sizes, "T": 512, "B": 256})
    else:
        tries.append({**sizes, "N": 65536})
    errors = []
    for attempt in tries:
        try:
            return cls(group, sizes=attempt, device=device, backend=backend, programs=programs,
                       **(extra or {}))
        except Exception as exc:  # noqa: BLE001 - retried, then reported together
            errors.append(f"sizes={attempt}: {type(exc).__name__}: {exc}")
    raise RuntimeError(f"cannot construct {cls.__name__}({backend}): " + " | ".join(errors))


def bind(fn: Callable[..., Any], env: dict[str, Any], slot: int
         ) -> tuple[list[Any], dict[str, Any]]:
    """Arguments for a step method from buffers by name (+ slot when it takes one)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == "slot":
            value: Any = slot
        elif p.name in env:
            value = env[p.name]
        elif p.default is not p.empty:
            continue
        else:
            raise TypeError(f"{getattr(fn, '__qualname__', fn)} wants {p.name!r}; "
                            f"have {sorted(env)}")
        if p.kind == p.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[p.name] = value
    return args, kwargs


def step_caller(inst: Any, schedule: str, step: str, env: dict[str, Any], slot: int = 0
                ) -> Callable[[], dict[str, torch.Tensor]]:
    """A zero-argument closure that runs one step and returns {written buffer: tensor}.

    Binding is done once (outside timed regions and graph captures); ``env`` is read at
    bind time, so later changes to it are not seen: bind again.
    """
    fn = getattr(inst, step)
    args, kwargs = bind(fn, env, slot)
    names = dict(STEPS[schedule])[step]

    def call() -> dict[str, torch.Tensor]:
        ret = fn(*args, **kwargs)
        if isinstance(ret, torch.Tensor):
            ret = (ret,)
        elif not isinstance(ret, (tuple, list)):
            ret = ()
        return dict(zip(names, ret, strict=False))

    return call


def run_steps(inst: Any, schedule: str, env: dict[str, Any], slot: int = 0,
              after: Callable[[str, dict[str, torch.Tensor]], None] | None = None
              ) -> dict[str, torch.Tensor]:
    """Run every step of a schedule in order; outputs feed later steps by buffer name.

    ``after(step, outputs)`` runs right after each step, on the same stream: snapshot
    peer-written buffers there, before a later step lets peers move on (domain.md).
    """
    env = dict(env)
    for step, _ in STEPS[schedule]:
        outs = step_caller(inst, schedule, step, env, slot)()
        if after is not None:
            after(step, outs)
        env.update(outs)
    return env


class Registry:
    """Module classes (loaded once) and instances per (schedule, H, backend), built lazily."""

    def __init__(self, modules_dir: Path | None, group: Any, device: torch.device,
                 fake: bool = False, programs: int | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.modules_dir = modules_dir
        self.programs = programs  # None: the modules' defaults
        self.extra = extra  # more constructor keywords (e.g. guard=False)
        self.group = group
        self.device = device
        self.fake = fake
        self.classes: dict[str, type] = {}
        self.instances: dict[tuple[str, int | None, str], Any] = {}

    def cls(self, schedule: str) -> type:
        """The schedule's class (the fake stand-in with ``fake``)."""
        if schedule not in self.classes:
            if self.fake:
                from benchmarks.support.fake import FakeModule

                self.classes[schedule] = FakeModule
            else:
                if self.modules_dir is None:
                    raise FileNotFoundError("no --modules directory")
                self.classes[schedule] = load_class(self.modules_dir, schedule)
        return self.classes[schedule]

    def get(self, schedule: str, H: int | None, backend: str) -> Any:
        """An instance for heads H (None for kv_gather) on a backend; collective when new."""
        key = (schedule, H, backend)
        if key not in self.instances:
            sizes = {} if H is None else {"H": H}
            self.instances[key] = instantiate(self.cls(schedule), self.group, sizes,
                                              self.device, backend, self.programs,
                                              self.extra)
        return self.instances[key]

    def close_all(self) -> None:
        """Close every instance (errors ignored: this runs on the way out)."""
        for inst in self.instances.values():
            try:
                inst.close()
            except Exception:  # noqa: BLE001
                pass
        self.instances.clear()
