"""The kernel plan: what the emitter needs, as a plain dataclass tree (JSON-dumpable).

Everything a template receives comes from here and is an identifier, an integer, an
enum string or a shape AST (``("num", n) | ("sym", name) | (op, lhs, rhs)``), except
``doc`` fields, which are free text and only ever reach the module escaped.
``effects`` and ``sync`` are dcpc.lang.semantics records made of the same kinds.

``dump_plan`` / ``load_plan``: the plan as lossless JSON (format ``PLAN_FORMAT``,
version ``PLAN_VERSION``): ``emit(load_plan(dump_plan(p)))`` is ``emit(p)`` byte for
byte. A loaded plan is only data: ``dcpc compile SCHEDULE --plan FILE`` lowers the
schedule again and emits the plan only where it is that lowering but for each step's
launch knobs (``EDITABLE``, bounded by ``editable_fault``), once the happens-before
checker has proved the plan (dcpc.pipeline ``run_plan``).
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from dcpc.lang.expr import COMPARISONS
from dcpc.lang.semantics import Effect, Region, Sync
from dcpc.topology import MeshWorld

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
    dtype: str  # a DType value (dcpc.lang.nodes.DType: bf16 ... fp8e5m2)
    kind: str  # engine (passed in) | symmetric | shared | output (module-owned, local)
    lse_base: str | None = None
    persist: bool = False  # one instance for all slots, zeros at construction, never reset
    # a chunk of a slot of the module's symmetric memory (``b[s][:, i]``, kind engine:
    # the module allocates none): the slot it is a view of, which the race models
    # take its accesses as (``views``), and where in it: index ``view_index`` of its axis
    # ``view_axis`` (``Schedule.slice_of``, ``Schedule.slice_axis``)
    view_of: str | None = None
    view_axis: int | None = None
    view_index: int | None = None


def views(buffers: Iterable[Any]) -> dict[str, str]:
    """The views of module memory among ``buffers`` (BufferPlans or dicts) -> the buffer
    each is a view of: the race models take a view's access as one of that buffer (a
    chunk read races with a put into its slot)."""
    def field(b: Any, name: str) -> Any:
        return b.get(name) if isinstance(b, dict) else getattr(b, name, None)

    return {field(b, "name"): field(b, "view_of") for b in buffers if field(b, "view_of")}


def chunks(buffers: Iterable[Any]) -> dict[str, tuple[int, int]]:
    """The views of module memory among ``buffers`` -> (the axis of the buffer they are
    a view of, their index along it): the race models take a local access of one as
    one of that chunk, apart from a store of scheme ``index`` along that axis whose
    part is another index (``b[s][e]`` beside source m's put into block m of slot s)."""
    def field(b: Any, name: str) -> Any:
        return b.get(name) if isinstance(b, dict) else getattr(b, name, None)

    return {field(b, "name"): (field(b, "view_axis") or 0, field(b, "view_index"))
            for b in buffers if field(b, "view_of") and field(b, "view_index") is not None}


def tracked(buffers: Iterable[Any]) -> dict[str, bool]:
    """The buffers the race models track (the checker's dcpc.check.hb.events and the
    execution oracle's), each -> one instance for all slots: the symmetric ones, and a
    persistent local one (one instance, touched by its own rank only). ``buffers``:
    BufferPlans, or their fields as dict keys (a plan read back from JSON)."""
    def field(b: Any, name: str) -> Any:
        return b.get(name) if isinstance(b, dict) else getattr(b, name, None)

    return {field(b, "name"): field(b, "kind") == "shared" or bool(field(b, "persist"))
            for b in buffers
            if field(b, "kind") in ("symmetric", "shared") or field(b, "persist")}


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


PLAN_FORMAT = "dcpc-plan"
PLAN_VERSION = 2  # bump when the encoding or a record's fields change
MAX_PLAN_BYTES = 64 * 1024 * 1024  # a dumped plan is a few hundred KiB at most
_MAX_DEPTH = 64  # shape ASTs nest a few levels; deeper is not a plan


class PlanFormatError(ValueError):
    """A plan file that is not a plan this dcpc reads; ``where``: the key path."""

    def __init__(self, where: str, message: str):
        super().__init__(f"at {where or 'the top'}: {message}")
        self.where = where


# The records a plan is made of, by the tag that names them in the JSON form.
_RECORDS: dict[str, type] = {cls.__name__: cls for cls in (
    Plan, SizePlan, BufferPlan, StepPlan, Effect, Region, Sync)}


def _encode(value: Any) -> Any:
    """JSON of one value, lossless: a list is an array; a tuple, a dict (its order and
    key types kept), a MeshWorld and each record are a one-key object naming the kind."""
    if value is None or type(value) in (bool, int, str, float):
        return value
    if type(value) is MeshWorld:
        return {"MeshWorld": list(value.shape)}
    if type(value) is list:
        return [_encode(v) for v in value]
    if type(value) is tuple:
        return {"tuple": [_encode(v) for v in value]}
    if type(value) is dict:
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if is_dataclass(value) and _RECORDS.get(type(value).__name__) is type(value):
        return {type(value).__name__: {f.name: _encode(getattr(value, f.name))
                                       for f in fields(value)}}
    raise TypeError(f"a plan holds a {type(value).__qualname__}, which its JSON form "
                    "does not carry")


def _decode(data: Any, where: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise PlanFormatError(where, f"nested deeper than {_MAX_DEPTH}")
    if type(data) is int and abs(data) >= _MAX_INT:
        raise PlanFormatError(where, f"an integer of more than {len(str(_MAX_INT)) - 1} digits")
    if data is None or type(data) in (bool, int, str, float):
        return data
    if isinstance(data, list):
        return [_decode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(data)]
    if not isinstance(data, dict) or len(data) != 1:
        kinds = ", ".join(["tuple", "dict", "MeshWorld", *_RECORDS])
        raise PlanFormatError(where, "expected a value, an array or an object of one key "
                              f"naming its kind ({kinds})")
    ((tag, body),) = data.items()
    here = f"{where}.{tag}" if where else tag
    if tag == "tuple" and isinstance(body, list):
        return tuple(_decode(v, f"{here}[{i}]", depth + 1) for i, v in enumerate(body))
    if tag == "dict" and isinstance(body, list):
        out: dict[Any, Any] = {}
        for i, pair in enumerate(body):
            if not isinstance(pair, list) or len(pair) != 2:
                raise PlanFormatError(f"{here}[{i}]", "expected a [key, value] pair")
            key = _decode(pair[0], f"{here}[{i}][0]", depth + 1)
            try:
                out[key] = _decode(pair[1], f"{here}[{i}][1]", depth + 1)
            except TypeError:  # an unhashable key
                raise PlanFormatError(f"{here}[{i}][0]", "a key must be a value") from None
        return out
    if tag == "MeshWorld" and isinstance(body, list) and body and all(
            type(s) is int and s >= 1 for s in body):
        return MeshWorld(body)
    cls = _RECORDS.get(tag)
    if cls is None or not isinstance(body, dict):
        raise PlanFormatError(where, f"unknown kind {tag!r} (or its body is not the "
                              "array or object it takes)")
    names = [f.name for f in fields(cls)]
    extra = sorted(set(body) - set(names))
    if extra:
        raise PlanFormatError(here, f"unknown field {extra[0]!r} of {tag}")
    missing = [n for n in names if n not in body]
    if missing:
        raise PlanFormatError(here, f"missing field {missing[0]!r} of {tag}")
    hints = typing.get_type_hints(cls)
    values = {}
    for n in names:
        values[n] = _decode(body[n], f"{here}.{n}", depth + 1)
        _check_kind(values[n], hints[n], f"{here}.{n}", n)
    return cls(**values)


_MAX_INT = 10**30  # the language's own integers have at most 30 digits (dcpc.lang.expr)
_EXPR_OPS = ("+", "-", "*", "/")
# Defence in depth, not the barrier: every string a template puts into code unescaped
# (names, enums, dtypes, slots' peers, a perm's peer set "perm:2,1,0", a grouped ragged
# step's slot arithmetic "peer * groups + g", effect keys, template paths) is made of
# these, so a string with a quote, a parenthesis, '=' or a line break is refused as it
# is read. The set does NOT keep a string from being code: names, attributes,
# subscripts, comprehensions and arithmetic can still call functions. What keeps input
# out of the module is dcpc.pipeline ``run_plan``: a loaded plan must be its schedule's
# lowering (``plan_difference``) but for EDITABLE fields, which hold ints only
# (``editable_fault``). Free text (``doc``, ``contract``) is escaped where it
# reaches the module.
_SAFE_TEXT = re.compile(r"[A-Za-z0-9_.+\-*/\[\] ,:]*")
_TEMPLATE = re.compile(r"ops/[a-z0-9_]+\.py\.j2")
_FREE_TEXT = ("doc", "contract")


def _is_expr(value: Any, depth: int = 0, ops: tuple[str, ...] = _EXPR_OPS) -> bool:
    """Whether ``value`` is a shape AST (dcpc.lang.expr) of at most _MAX_DEPTH levels,
    its operators among ``ops`` (a condition's arithmetic: ``_CONDITION_ARITHMETIC``)."""
    if type(value) is not tuple or depth > _MAX_DEPTH:
        return False
    if len(value) == 2 and value[0] == "num":
        return type(value[1]) is int
    if len(value) == 2 and value[0] == "sym":
        return type(value[1]) is str and value[1].isidentifier()
    return len(value) == 3 and value[0] in ops and all(
        _is_expr(v, depth + 1, ops) for v in value[1:])


def _fits(value: Any, hint: Any) -> bool:
    """Whether a decoded value has the kind a record field is annotated with."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is tuple:  # Expr
        return _is_expr(value)
    if hint in (int, str, bool, float):
        return type(value) is hint or (hint is int and type(value) is MeshWorld)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return type(value) is list and all(_fits(v, args[0]) for v in value)
    if origin is tuple:
        if type(value) is not tuple:
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(
            _fits(v, a) for v, a in zip(value, args, strict=True))
    if origin is dict:
        return type(value) is dict and all(_fits(k, args[0]) and _fits(v, args[1])
                                           for k, v in value.items())
    if isinstance(hint, type) and hint in _RECORDS.values():
        return type(value) is hint
    return False


# a condition (a step's ``when:``, dcpc.lang.expr.parse_condition, held in its plan's
# ``attrs["when"]``): the one value of a plan whose tuples may hold these at their head
_LOGIC = frozenset(("and", "or"))
_CONDITION_ARITHMETIC = (*_EXPR_OPS, "%")  # a tuple: ``in`` compares, never hashes


def _is_condition(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a condition's AST: comparisons of expressions (``+ - * / %``
    over ``("num", int)`` / ``("sym", identifier)``) joined by and / or / not."""
    if type(value) is not tuple or not value or type(value[0]) is not str or depth > _MAX_DEPTH:
        return False
    head = value[0]
    if head == "not":
        return len(value) == 2 and _is_condition(value[1], depth + 1)
    if head in _LOGIC:
        return len(value) == 3 and all(_is_condition(v, depth + 1) for v in value[1:])
    return head in COMPARISONS and len(value) == 3 and all(
        _is_expr(v, depth + 1, _CONDITION_ARITHMETIC) for v in value[1:])


def _strings(value: Any) -> typing.Iterator[str]:
    if type(value) is str:
        yield value
    elif type(value) in (list, tuple):
        for v in value:
            yield from _strings(v)
    elif type(value) is dict:
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)


def _check_kind(value: Any, hint: Any, where: str, name: str) -> None:
    if not _fits(value, hint):
        raise PlanFormatError(where, f"not a value of the field's kind ({hint})")
    if name == "template" and value is not None and not _TEMPLATE.fullmatch(value):
        raise PlanFormatError(where, "not a template of an op (ops/<op>.py.j2)")
    if name == "attrs" and value.get("when") is not None:
        if not _is_condition(value["when"]):
            raise PlanFormatError(f"{where}['when']", "not a condition's AST (comparisons "
                                  "of +, -, *, /, % over numbers and names; and, or, not)")
        value = {k: v for k, v in value.items() if k != "when"}  # its operators checked
    if name not in _FREE_TEXT:
        for text in _strings(value):
            if not _SAFE_TEXT.fullmatch(text):
                raise PlanFormatError(where, f"the string {text[:80]!r} holds a character "
                                      "no name, enum or shape of a plan has")


# What ``dcpc compile --plan`` lets a plan differ in from its schedule's lowering: each
# step's launch knobs (ints, emitted into the module's TUNING table). Nothing else: the
# rest of the plan must be the lowering's, value for value. Not ``sync``: the kernels'
# signals and waits come from the op and its attrs, not from the plan's Sync, so an
# edited Sync would be proved by the hb stage while the module ran the lowering's.
EDITABLE = ("tuning",)


def plan_difference(got: Any, want: Any, where: str = "plan") -> str | None:
    """The key path (as ``PlanFormatError`` names them, ``plan.Plan.steps[3].StepPlan.
    attrs['peer_k']``) of the first place where the plan ``got`` is not ``want`` (values
    and their types, dict keys too), each step's EDITABLE fields left out; None where
    they agree."""
    if type(got) is not type(want):
        return where
    if type(got) in (list, tuple):
        if len(got) != len(want):
            return f"{where} (its length)"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            found = plan_difference(g, w, f"{where}[{i}]")
            if found:
                return found
        return None
    if type(got) is dict:
        if [(type(k), k) for k in got] != [(type(k), k) for k in want]:
            return f"{where} (its keys)"
        for k in got:
            found = plan_difference(got[k], want[k], f"{where}[{k!r}]")
            if found:
                return found
        return None
    if type(got) is MeshWorld:
        return None if got.shape == want.shape else where
    if is_dataclass(got):
        here = f"{where}.{type(got).__name__}"
        for f in fields(got):
            if type(got) is StepPlan and f.name in EDITABLE:
                continue
            found = plan_difference(getattr(got, f.name), getattr(want, f.name),
                                    f"{here}.{f.name}")
            if found:
                return found
        return None
    return None if got == want else where


def editable_fault(got: Plan, want: Plan) -> tuple[str, str] | None:
    """(key path, what is wrong) of the first EDITABLE field of ``got`` (a loaded plan
    that ``plan_difference`` finds like ``want``, its schedule's lowering) that holds
    no value its field takes: a launch knob the lowering does not set, not an int
    (``type(value) is int``: no bool, no MeshWorld), or out of its bounds (dcpc.tuning)."""
    from dcpc.tuning import TUNING_KNOBS, knob_ok

    for i, (g, w) in enumerate(zip(got.steps, want.steps, strict=True)):
        here = f"plan.Plan.steps[{i}].StepPlan"
        if list(g.tuning) != list(w.tuning):
            return (f"{here}.tuning", f"the knobs are the lowering's ({', '.join(w.tuning)}"
                    " or none): a value may be edited, not a knob added or removed")
        for knob, value in g.tuning.items():
            if type(value) is not int or not knob_ok(knob, value):
                return (f"{here}.tuning[{knob!r}]", f"{str(value)[:80]} is out of bounds: "
                        f"{TUNING_KNOBS[knob]}")
    return None


def dump_plan(plan: Plan) -> str:
    """The plan's lossless JSON form (``load_plan`` reads it back)."""
    return json.dumps({"format": PLAN_FORMAT, "version": PLAN_VERSION,
                       "plan": _encode(plan)}, indent=1) + "\n"


def _no_constant(name: str) -> Any:
    """NaN and Infinity, which Python's JSON reads by default: no plan holds them."""
    raise ValueError(f"{name} is no JSON number")


def load_plan(text: str | bytes) -> Plan:
    """The plan of a ``dump_plan`` text; a text that is not one raises PlanFormatError
    naming the key path where it goes wrong. The plan is not checked here: see
    dcpc.pipeline ``run_plan``."""
    if len(text) > MAX_PLAN_BYTES:
        raise PlanFormatError("", f"the file is larger than {MAX_PLAN_BYTES} bytes")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        raise PlanFormatError("", f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanFormatError("", "expected an object with format, version and plan")
    if data.get("format") != PLAN_FORMAT:
        raise PlanFormatError("format", f"expected {PLAN_FORMAT!r}, got "
                              f"{str(data.get('format'))[:80]!r}")
    if type(data.get("version")) is not int or data["version"] != PLAN_VERSION:
        raise PlanFormatError("version", f"unknown version {str(data.get('version'))[:80]}; "
                              f"this dcpc reads version {PLAN_VERSION} (dump the plan again)")
    extra = sorted(set(data) - {"format", "version", "plan"})
    if extra:
        raise PlanFormatError(extra[0], "unknown key")
    plan = _decode(data.get("plan"), "plan")
    if not isinstance(plan, Plan):
        raise PlanFormatError("plan", "expected a Plan record")
    return plan
