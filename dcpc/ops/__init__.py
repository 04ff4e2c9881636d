"""The ops of the schedule language, one module each, registered in ``OPS``.

A module holds everything an op means: its pydantic model, its semantics (effects
and sync), its shape and dtype verifier, its float64 reference, its io, its Triton
lowering rule and, when no collective of dcpc/runtime/collectives.py serves it, its own
torch body (``OpDef.torch``, copied into the generated modules). Importing
this package imports every module of it, and each op module registers itself; the order of
``MODULES``, then the other ops by name, is the language's op order (``OP_NAMES``). See
dcpc/ops/registry.py for the record, docs/internals.md for the recipe.
"""

import pkgutil
from importlib import import_module

from dcpc.ops.registry import OPS, OpDef

# The language's op order for the ops it began with (error hints and the JSON Schema list
# the ops in it, so their texts stay put); an op module not named here is found by the
# scan below and joins after them, by name: adding an op touches no file but its own.
MODULES = (
    "all_gather", "all_to_all", "lse_combine", "all_to_all_combine", "reduce_scatter",
    "lse_correct", "copy", "sync", "external",
    "shift",
    "all_reduce", "broadcast", "reduce",
    "ragged_all_to_all", "weighted_combine",
)
_FOUND = sorted(info.name for info in pkgutil.iter_modules(__path__)
                if not info.name.startswith("_"))
for _module in (*MODULES, *(name for name in _FOUND if name not in MODULES)):
    import_module(f"dcpc.ops.{_module}")  # an op module registers itself (define)

OP_NAMES: tuple[str, ...] = tuple(OPS)

__all__ = ["MODULES", "OPS", "OP_NAMES", "OpDef"]
