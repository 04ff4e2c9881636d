"""Importing a generated module from its file, and finding its class: what an engine
does with ``build/generated`` or the adapters' cache (no compiler needed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(path: str | Path, name: str) -> ModuleType:
    """The module in ``path`` under the name ``name`` (imported once per process: a name
    already in ``sys.modules`` is that module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the generated module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def schedule_class(module: ModuleType) -> type:
    """The one ``ScheduleModule`` subclass a generated module defines."""
    from dcpc.runtime.module import ScheduleModule

    (cls,) = [v for v in vars(module).values() if isinstance(v, type)
              and issubclass(v, ScheduleModule) and v is not ScheduleModule]
    return cls
