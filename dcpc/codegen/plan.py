"""The kernel plan: what the emitter needs, as a plain dataclass tree (JSON-dumpable).

Everything a template receives comes from here and is an identifier, an integer, an
enum string or a shape AST (``("num", n) | ("sym", name) | (op, lhs, rhs)``), except
``doc`` fields, which are free text and only ever reach the module escaped.
``effects`` and ``sync`` are dcpc.lang.semantics records made of the same kinds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dcpc.lang.semantics import Effect, Sync

Expr = tuple  # a shape AST, as in dcpc.lang.expr


@dataclass
class SizePlan:
    name: str
    kind: str  # const | max | multiple_of | axis (sizes a mesh axis: bound at construction)
    value: int | None = None  # the constant or the max; an axis' position
    multiple_of: Expr | None = None


@dataclass
class BufferPlan:
    name: str
    shape: list[Expr]
    dtype: str  # bf16 f16 f32 i32 i64 fp8e4m3
    kind: str  # engine (passed in) | symmetric | shared | output (module-owned, local)
    lse_base: str | None = None


@dataclass
class StepPlan:
    name: str
    index: int
    op: str
    template: str | None  # "ops/<op>.py.j2"; None for external steps
    doc: str | None = None
    params: list[str] = field(default_factory=list)  # engine buffers read, in order
    returns: list[str] = field(default_factory=list)  # buffers returned, as views
    roles: dict[str, str] = field(default_factory=dict)  # role -> buffer name
    scalars: list[tuple[str, Expr]] = field(default_factory=list)  # per call, in order
    statics: dict[str, Expr] = field(default_factory=dict)  # evaluated at the maxima
    tiles: list[Expr] = field(default_factory=list)  # row length of each tile space
    scratch: dict[str, tuple[Expr, str]] = field(default_factory=dict)  # torch backend
    attrs: dict[str, Any] = field(default_factory=dict)  # ints, enums, identifiers
    # role -> (a, b, unit): the kernel addresses the role's buffer as three axes, dims
    # [:a], [a:b], [b:], each with one stride (``unit``: the last axis' stride must be 1).
    # Engine buffers pass their tensors' strides (strided inputs without a copy);
    # module-owned ones their packed strides (scalars ``<role>_s0..2``).
    layouts: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    tuning: dict[str, int] = field(default_factory=dict)  # programs, num_warps, block
    signalling: bool = False  # uses signal slots (a channel per slot)
    reads: list[str] = field(default_factory=list)  # external steps: for the contract
    writes: list[str] = field(default_factory=list)
    # From dcpc.lang.semantics, the one definition: what the step reads and writes, in
    # the order it happens, and the signal slots its kernel signals and polls. The
    # happens-before checker and the execution oracle analyse exactly these.
    effects: list[Effect] = field(default_factory=list)
    sync: Sync = field(default_factory=Sync)


@dataclass
class Plan:
    schedule: str
    class_name: str
    version: str
    source_sha256: str
    source_name: str
    worlds: list[int]
    slots: int
    loop_world: int | tuple[int, ...] | None  # the W or mesh shape a loop names: served only
    streams: str
    doc: str | None
    sizes: list[SizePlan]
    buffers: list[BufferPlan]
    steps: list[StepPlan]
    contract: list[str]
    # the mesh (dcpc.lang.mesh): (axis, its size name or int) outermost first; () for
    # a schedule without ``mesh:`` (one axis of W)
    mesh: tuple[tuple[str, str | int], ...] = ()

    def buffer(self, name: str) -> BufferPlan:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)
