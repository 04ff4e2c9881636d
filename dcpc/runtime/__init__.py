"""dcpc.runtime: what generated modules import (torch and triton only, no compiler code).

Generated modules use ``ScheduleModule`` (construction, binding, views), ``Buf`` (the
buffer table), the heaps (``make_heap``), the signal bank (``sync``), argument checks
(``validate``), shape evaluation (``shapes``), the reference math (``merge``) and the
eager launch path of their kernels (``fast_launch``) and their call plans (``calls``).
"""

from dcpc.runtime import calls, collectives, merge, shapes, sync, tiles, validate
from dcpc.runtime.backend import make_heap, resolve_backend
from dcpc.runtime.errors import (
    DcpcArgumentError,
    DcpcCollectiveError,
    DcpcConcurrentUseError,
    DcpcConstructionError,
    DcpcContractError,
    DcpcError,
    DcpcFailedError,
    DcpcPeerFailedError,
    DcpcScaleError,
    DcpcTimeoutError,
)
from dcpc.runtime.fastlaunch import fast_launch
from dcpc.runtime.guard import guarded
from dcpc.runtime.heap import SymmetricBuffer, SymmetricHeap
from dcpc.runtime.module import Buf, ModuleOfWorlds, ScheduleModule, Tune

__all__ = [
    "Buf",
    "DcpcArgumentError",
    "DcpcCollectiveError",
    "DcpcConcurrentUseError",
    "DcpcConstructionError",
    "DcpcContractError",
    "DcpcError",
    "DcpcFailedError",
    "DcpcPeerFailedError",
    "DcpcScaleError",
    "DcpcTimeoutError",
    "ModuleOfWorlds",
    "ScheduleModule",
    "SymmetricBuffer",
    "SymmetricHeap",
    "Tune",
    "calls",
    "collectives",
    "fast_launch",
    "guarded",
    "make_heap",
    "merge",
    "resolve_backend",
    "shapes",
    "sync",
    "tiles",
    "validate",
]
