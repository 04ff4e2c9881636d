"""The launch knobs of a generated module's kernels and their bounds, defined once: the
runtime checks a constructor's ``tuning=`` by them (dcpc.runtime.validate) and the
compiler a loaded plan's ``tuning`` (dcpc.codegen.plan ``editable_fault``, ``dcpc
compile --plan``). A leaf module: stdlib only, no torch, no compiler code."""

from __future__ import annotations

# knob -> (what it is, the values it takes): its largest value, and whether it must be
# a power of two; every knob is an int >= 1 (never a bool)
TUNING_KNOBS = {
    "programs": "programs per launch, 1..1024",
    "num_warps": "warps per program, a power of two 1..32",
    "block": "elements per tile, a power of two 1..65536",
    "tiles_per_program": "tiles per program below the program cap, 1..1024",
}
_TOP = {"programs": 1024, "num_warps": 32, "block": 65536, "tiles_per_program": 1024}
_POW2 = frozenset(("num_warps", "block"))


def knob_ok(knob: str, value: object) -> bool:
    """Whether ``value`` is a value the launch knob ``knob`` takes (TUNING_KNOBS)."""
    return (knob in _TOP and isinstance(value, int) and not isinstance(value, bool)
            and 1 <= value <= _TOP[knob]
            and not (knob in _POW2 and value & (value - 1)))
