"""The op registry: one ``OpDef`` per op, keyed by the op's name.

Every stage reads an op through its entry: the model's discriminated union
(dcpc.lang.model), the effects and sync (dcpc.lang.semantics), the shape and dtype
verifier (dcpc.check.ops), the float64 reference (dcpc.harness.simulate) and what a
step reads and writes and what its inputs must respect, for synthetic inputs
(dcpc.harness.synth), what of its outputs ``dcpc run`` compares (dcpc.harness.worker),
and the Triton
lowering rule (dcpc.codegen.lower), whose template is templates/ops/<name>.py.j2. The
torch backend is the op template's ``torch_body`` macro: a call of a collective of
dcpc/runtime/collectives.py, or of the op's own torch body (``OpDef.torch``), which the
emitter copies into the generated module (the runtime imports no compiler code).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dcpc.lang.nodes import BUFFER_KEYS, Name
from dcpc.ops.iface import Counts, Placement

if TYPE_CHECKING:
    from dcpc.lang.nodes import OpBase, ScheduleView, Step
    from dcpc.ops.common import Scope, Semantics
    from dcpc.ops.iface import InputRule, LowerRules, OutputRule, ShapeRules, SimView

IO = tuple[list[str], list[str]]


@dataclass(frozen=True)
class OpDef:
    """Everything an op means, in one record.

    ``semantics(scope, step)``: its buffer effects and signal slots.
    ``verify(v, step)``: its shape, dtype and base rules (``v``: the ``ShapeRules`` of
    dcpc.ops.iface, which the check stage's ``dcpc.check.ops.Verify`` implements); None
    for an op with nothing to check beyond its names.
    ``reference(sim, step)``: what it does to every rank's buffers in float64 (``sim``:
    the ``SimView`` of dcpc.ops.iface, which ``dcpc.harness.simulate.Sim`` implements).
    ``io(op)``: (buffers it reads, buffers it writes), in the order the step names them.
    ``lower(ctx, step)``: its Triton lowering, the step's ``dcpc.codegen.plan.StepPlan``
    for templates/ops/<name>.py.j2 (``ctx``: the ``LowerRules`` of dcpc.ops.iface, which
    the lowering's ``dcpc.codegen.ctx.Ctx`` implements; it makes the plan).
    ``teams``: whether the op may run over a subset of a mesh's axes (``axis:``, its
    team: dcpc.lang.mesh); an op without it runs over every axis only.
    ``whole_mesh_form(op)``: for an op with teams, the forms of it that still run over
    every axis only: a description of the step's form ("all_to_all with a cast"), or
    None when this step may take a team; ``team_form``: how the docs name the forms
    that take a team ("dim"), empty when all of them do.
    ``exact``: the op moves bits (``dcpc run`` compares its outputs bit for bit);
    ``computes(op)``: a step of an exact op that computes instead (pull with ``reduce``),
    None: none does; ``moves(op)`` says it for one step.
    ``inputs(op)``: what ``dcpc run``'s synthetic values of the buffers it reads must
    respect (dcpc.ops.iface ``InputRule``: counts within a capacity, rows that exist, an
    fp8 scale, the request mask), by buffer; None: nothing (dcpc.harness.synth).
    ``outputs(op)``: what ``dcpc run`` may leave uncompared of the buffers it writes
    (dcpc.ops.iface ``OutputRule``: ``Unsent``, elements no rank sent), by buffer;
    None: every written element is compared (dcpc.harness.worker).
    ``torch``: the op's torch-backend body, when no collective of
    dcpc/runtime/collectives.py serves it: a function ``(comm, *args)`` (``comm``: the
    ``TorchComm`` of dcpc.ops.iface, which the runtime's ``SlotGroup`` implements) that
    imports what it needs of torch inside itself; dcpc.codegen.emit copies its source,
    without the signature's annotations, into every generated module that has the op, as
    ``_<name>_torch`` (``torch_name``), which the template's ``torch_body`` macro calls.
    ``torch_uses``: the op's own functions that body calls (a rule the reference shares,
    one definition), copied before it as ``_<name>_<function>``, the name the body
    calls them by (the op's module binds that name to the function too).
    ``calls_torch(step)``: which lowered steps (a ``StepPlan``) call that body (None:
    every step of the op); the emitter writes the body into a module only when one of
    its steps does (``torch_called``), and the template asks the same question.
    """

    name: str
    model: type[OpBase]
    semantics: Callable[[Scope, Step], Semantics]
    verify: Callable[[ShapeRules, Step], None] | None
    reference: Callable[[SimView, Step], None]
    io: Callable[[Any], IO]
    lower: Callable[[LowerRules, Step], Any]
    teams: bool = False
    whole_mesh_form: Callable[[Any], str | None] | None = None
    team_form: str = ""
    exact: bool = False
    engine: bool = False  # the engine's own step (external): what it writes is no move
    inputs: Callable[[Any], dict[str, InputRule]] | None = None
    outputs: Callable[[Any], dict[str, OutputRule]] | None = None
    torch: Callable[..., None] | None = None
    computes: Callable[[Any], bool] | None = None
    calls_torch: Callable[[Any], bool] | None = None
    torch_uses: tuple[Callable[..., Any], ...] = ()

    def moves(self, op: OpBase) -> bool:
        """Whether this step moves bits (compared bit for bit by ``dcpc run``)."""
        return self.exact and not (self.computes is not None and self.computes(op))

    def takes_team(self, op: OpBase) -> bool:
        """Whether this step of the op may run over a team (``axis:``)."""
        return self.teams and self.whole_mesh_form_of(op) is None

    def whole_mesh_form_of(self, op: OpBase) -> str | None:
        return self.whole_mesh_form(op) if self.whole_mesh_form is not None else None

    def torch_called(self, step: Any) -> bool:
        """Whether lowered step ``step`` (a ``StepPlan``) calls the op's own torch body."""
        return self.torch is not None and (self.calls_torch is None or self.calls_torch(step))

    @property
    def torch_name(self) -> str:
        """The name a generated module gives the op's own torch body (``torch``)."""
        return f"_{self.name}_torch"


OPS: dict[str, OpDef] = {}


def define(op: OpDef) -> OpDef:
    """Register ``op`` (once per name; the order of registration is the language's)."""
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} is defined twice")
    unlisted = sorted(set(buffer_fields(op.model)) - set(BUFFER_KEYS))
    if unlisted:
        raise ValueError(f"op {op.name!r}: its buffer keys {unlisted} are not in "
                         "dcpc.lang.nodes.BUFFER_KEYS (say there whether it reads or writes them)")
    OPS[op.name] = op
    return op


def input_rules(schedule: ScheduleView) -> list[dict[str, InputRule]]:
    """Every step's rules for the values of the buffers it reads (its op's ``inputs``),
    in step order: what ``dcpc run``'s synthetic values respect (dcpc.harness.synth) and
    what a buffer's declared ``values`` range is checked against (dcpc.check.names)."""
    found: list[dict[str, InputRule]] = []
    for step in schedule.step_list():
        rules = OPS[step.op.op].inputs
        found.append(rules(step.op) if rules is not None else {})
    return found


def is_move(op: OpBase) -> bool:
    """An op that moves bits (``OpDef.exact``, ``OpDef.moves``), not an engine step."""
    spec = OPS[op.op]
    return spec.moves(op) and not spec.engine


def carries(op: OpBase) -> list[tuple[str, str]]:
    """(src, dst) of each payload a move carries: src[k] into dst[k] (as each op's
    ``semantics`` and the checker's ``pairs`` take them)."""
    return list(zip(names(getattr(op, "src", None)), names(getattr(op, "dst", None)),
                    strict=False))


def writer(schedule: ScheduleView, name: str) -> Step | None:
    """The first step that writes ``name``, a slice of it or the buffer it is a slice of
    (a ``values`` end that names a buffer never names one a step writes: dcpc.check.names,
    and the hint of dcpc.lang.sizes)."""
    part = schedule.slice_of(name)
    same = {name, *schedule.cells(name), *(part[:1] if part else ())}
    return next((step for step in schedule.step_list()
                 if same & set(OPS[step.op.op].io(step.op)[1])), None)


def count_capacities(schedule: ScheduleView) -> dict[str, list[str]]:
    """The buffers ops read as row counts (``Counts``), each with the capacities (size
    expressions) of the steps that read it so, in step order. ``dcpc run`` draws a count
    in 0 .. the least (dcpc.harness.synth ``count_capacities``); a ``values`` end that
    names such a buffer needs one capacity (dcpc.check.names ``_bound_buffers``)."""
    found: dict[str, list[str]] = {}
    for rules in input_rules(schedule):
        for name, rule in rules.items():
            if isinstance(rule, Counts):
                found.setdefault(name, []).append(rule.capacity)
    return found


def placed(schedule: ScheduleView) -> dict[str, str]:
    """The integer buffers a ragged move reads as its ``index`` (``Placement``), each with
    its slot's capacity (a size expression): the index itself, and a move's src that lands
    in it (DeepEP's token indices, sent by the dispatch, placing the combine's rows). One
    pass in step order: a src that lands in such a src (two hops) is not followed. What
    ``dcpc run`` draws distinct within the slot (dcpc.harness.synth) and what a declared
    ``values`` range must meet (dcpc.check.names)."""
    found = {name: rule.capacity for rules in input_rules(schedule)
             for name, rule in rules.items() if isinstance(rule, Placement)}
    for step in schedule.step_list():
        if is_move(step.op):
            found |= {src: found[dst] for src, dst in carries(step.op)
                      if dst in found and src not in found}
    return found


def buffer_fields(model: type[OpBase]) -> list[str]:
    """The fields of an op's model that hold buffer names (typed ``Name``)."""
    hints = typing.get_type_hints(model, include_extras=True)
    return [f for f in model.model_fields if _names_a_buffer(hints.get(f))]


def _names_a_buffer(hint: object) -> bool:
    return hint == Name or any(_names_a_buffer(a) for a in typing.get_args(hint))


def names(value: str | list[str] | None) -> list[str]:
    """A key's buffer names, whether it holds one name or a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
