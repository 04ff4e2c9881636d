"""What every structural pass shares: the schedule, its sizes, and the diagnostics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dcpc.diagnostics import Diagnostic, Mark
from dcpc.lang import expr as ex
from dcpc.lang.mesh import mesh_of
from dcpc.lang.model import Buffer, OpBase, Schedule, Step
from dcpc.lang.nodes import BUFFER_KEYS
from dcpc.lang.questions import Counterexample, Samples
from dcpc.lang.sizes import SizeTable
from dcpc.ops.common import Channels, channels
from dcpc.ops.iface import Ref  # defined below the ops, which build them too

if TYPE_CHECKING:
    from dcpc.lang.semantics import Semantics

W = ex.W  # the group size symbol (dcpc.lang.expr)
UNDECIDED_HINT = ("write it as a simpler expression of the sizes (a product of sizes and "
                  "small sums), or lower the 'max' of its sizes")
# the budget is the whole file's: what spent it is the file's largest expressions, not
# necessarily the one named (the first shape-undecided error names where it ran out)
SPENT_HINT = ("the file's shape questions share one budget: simplify its largest shape "
              "expressions (products or powers of several sizes with large 'max'), or "
              "lower those sizes' 'max'")


def team_expr(ctx: Context, step: Step) -> ex.Expr:
    """The size of a step's team (dcpc.lang.mesh): W, or ``G`` for a team op; replaces
    W in its shape rules."""
    return mesh_of(ctx.schedule).team_size(step.op)


@dataclass
class Context:
    schedule: Schedule
    table: SizeTable
    samples: Samples
    steps: list[Step]
    semantics: list[Semantics]  # every step's effects and sync (dcpc.lang.semantics.table)
    out: list[Diagnostic] = field(default_factory=list)
    _channels: Channels | None = field(default=None, init=False, repr=False)

    @property
    def channels(self) -> Channels:
        """Which signal step each wait polls (``dcpc.ops.common.channels``), matched once
        per check: every wait's verifier and check_channels ask it."""
        if self._channels is None:
            self._channels = channels(self.schedule)
        return self._channels

    def error(
        self, mark: Mark, code: str, message: str, hint: str | None = None,
        severity: str = "error",
    ) -> None:
        self.out.append(Diagnostic(mark, code, message, hint=hint, severity=severity))

    def undecided(self, mark: Mark, what: str, example: Counterexample | None) -> bool:
        """A shape question the exact search left undecided (its expression too large, or
        the check's one budget spent) is reported as ``shape-undecided``, never read as
        the question's finding (a division found inexact, a dimension nonpositive): True
        when ``example`` is such an answer (reported here: the caller says nothing else)."""
        if example is None or not example.undecided:
            return False
        self.error(mark, "shape-undecided", f"{what} cannot be checked for every binding of "
                   f"its sizes: {example.detail}",
                   hint=SPENT_HINT if example.spent else UNDECIDED_HINT)
        return True

    def buffer(self, name: str) -> Buffer | None:
        return self.schedule.buffers.get(name)

    def shape(self, name: str) -> list[ex.Expr] | None:
        """The parsed shape of a declared buffer, or None (unknown or broken shape)."""
        return self.table.shapes.get(name)

    def file_mark(self) -> Mark:
        return Mark(self.schedule.source_file, 0, 0)


_HAS: dict[tuple[type, str], bool] = {}


def _field(op: OpBase, key: str) -> object:
    """``getattr(op, key, None)`` without pydantic's slow miss (an op model forbids
    extra keys, so a name that is neither a field nor a class attribute is absent;
    which names an op class has is asked once per class)."""
    cls = type(op)
    has = _HAS.get((cls, key))
    if has is None:
        has = _HAS[(cls, key)] = key in cls.model_fields or hasattr(cls, key)
    return getattr(op, key, None) if has else None


def refs(op: OpBase, key: str) -> list[Ref]:
    """The buffers an op names under ``key`` (a name or a list of names), with marks."""
    value = _field(op, key)
    role = key.rstrip("_")
    if isinstance(value, str):
        return [Ref(value, role, op.mark(key))]
    if isinstance(value, list):
        return [Ref(v, role, op.mark(f"{key}[{i}]")) for i, v in enumerate(value)]
    return []


def mask_refs(op: OpBase) -> list[Ref]:
    mask = _field(op, "mask_empty")
    if mask is None:
        return []
    key = mask.lengths_key
    return [
        Ref(mask.lengths, f"mask_empty.{key}", mask.mark(key)),
        Ref(mask.query_start_loc, "mask_empty.query_start_loc", mask.mark("query_start_loc")),
    ]


def all_refs(op: OpBase) -> list[Ref]:
    """Every buffer an op names, in the order the step lists them."""
    found: list[Ref] = []
    for key in BUFFER_KEYS:
        found += refs(op, key)
    scale = _field(op, "scale")  # a cast's scale (dcpc/ops/cast.py)
    if scale is not None:
        found.append(Ref(scale.buffer, "scale.buffer", scale.mark("buffer")))
    return found + mask_refs(op)


def show(shape: Sequence[ex.Expr]) -> str:
    return "[" + ", ".join(ex.unparse(simplify(d)) for d in shape) + "]"


def simplify(node: ex.Expr) -> ex.Expr:
    """Cancel the W factors the checker itself introduces (``W*(H/W)`` reads as ``H``)."""
    if node[0] in ("num", "sym"):
        return node
    op, lhs, rhs = node[0], simplify(node[1]), simplify(node[2])
    if op == "*" and lhs == W and rhs[0] == "/" and rhs[2] == W:
        return rhs[1]
    if op == "/" and rhs == W and lhs[0] == "*" and W in (lhs[1], lhs[2]):
        return lhs[2] if lhs[1] == W else lhs[1]
    return (op, lhs, rhs)
