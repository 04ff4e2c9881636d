"""Importing a generated module from its file, and finding its class: what an engine
does with ``build/generated`` or the adapters' cache (no compiler needed)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

_lock = threading.RLock()  # ranks as threads import at once: one import, complete


def import_file(path: str | Path, name: str) -> ModuleType:
    """The module in ``path`` under the name ``name``, imported once per process: a module
    of that name already imported from the same file is returned; one from another file
    is replaced (two builds of one schedule in one process get their own code)."""
    path = Path(path)
    with _lock:
        known = sys.modules.get(name)
        if known is not None and Path(getattr(known, "__file__", "") or "") == path:
            return known
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import the generated module {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module


def schedule_class(module: ModuleType, schedule: str | None = None) -> type:
    """The one ``ScheduleModule`` subclass a generated module defines (with ``schedule``:
    the one whose ``SCHEDULE`` is that name); ImportError when there is none."""
    from dcpc.runtime.module import ScheduleModule

    found = [v for v in vars(module).values() if isinstance(v, type)
             and issubclass(v, ScheduleModule) and v is not ScheduleModule
             and (schedule is None or getattr(v, "SCHEDULE", None) == schedule)]
    # a module of several W: its per-W classes (LOOP_WORLDS' values) are not the entry
    variants = {id(c) for v in found for c in getattr(v, "LOOP_WORLDS", {}).values()}
    found = [v for v in found if id(v) not in variants]
    if len(found) != 1:
        what = f" with SCHEDULE = {schedule!r}" if schedule else ""
        raise ImportError(f"{getattr(module, '__file__', module)} defines {len(found)} "
                          f"schedule classes{what}, expected one")
    return found[0]
