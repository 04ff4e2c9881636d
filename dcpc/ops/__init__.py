"""The ops of the schedule language, one module each, registered in ``OPS``.

A module holds everything an op means: its pydantic model, its semantics (effects
and sync), its shape and dtype verifier, its float64 reference, its io and its Triton
lowering rule (the torch backend alone is elsewhere: dcpc/runtime/collectives.py). Importing
this package registers them all; the order of ``MODULES`` is the language's op order
(``OP_NAMES``: error hints and the JSON Schema list the ops in it). See
dcpc/ops/registry.py for the record, docs/internals.md for the recipe.
"""

from importlib import import_module

from dcpc.ops.registry import OPS, OpDef

MODULES = (
    "all_gather", "all_to_all", "lse_combine", "all_to_all_combine", "reduce_scatter",
    "lse_correct", "copy", "sync", "external",
    "shift",
    "all_reduce", "broadcast", "reduce",
    "ragged_all_to_all", "weighted_combine",
)
for _module in MODULES:
    import_module(f"dcpc.ops.{_module}")

OP_NAMES: tuple[str, ...] = tuple(OPS)

__all__ = ["MODULES", "OPS", "OP_NAMES", "OpDef"]
