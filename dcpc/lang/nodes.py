"""The language's building blocks: scalar types, buffers, sizes, ``OpBase``, ``Step``,
and ``ScheduleView``, what the ops and the mesh read of a schedule.

The op models themselves are defined with the rest of each op in ``dcpc.ops``;
``dcpc.lang.model`` assembles them into ``Schedule``. Models validate types and keys
only; cross-references, shapes and ordering are the check stage's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal, Protocol, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from dcpc.diagnostics import NOWHERE, Mark
from dcpc.lang.yamlsrc import MARK, MARKS
from dcpc.numerics import FP8_FORMATS

# the key the unroller (dcpc.lang.loops) marks a 1-d slot's chunk with: a 0-d view of the
# module's memory (shape []), which no file declares
ELEMENT = "__element__"

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Name = Annotated[str, Strict(), Field(description="A name declared under buffers")]
ChannelName = Annotated[str, Strict(), Field(description="A signal channel's name")]
# The keys of a step that hold buffer names (``Name`` fields), in the order a step lists
# them, with what the step does to the buffers: "read" or "write". Defined once: the
# checker's reference, aliasing and flow rules read it, and an op whose model has a
# ``Name`` field missing here is refused when it is registered (dcpc.ops.registry).
# A cast's ``scale.buffer`` and ``mask_empty``'s buffers are nested, not keys of a step.
BUFFER_KEYS: dict[str, str] = {
    "src": "read", "via": "write", "dst": "write", "return_lse": "write",
    "output_scale": "read", "reads": "read", "writes": "write",
    "counts": "read", "recv_counts": "write", "index": "read",
}
SizeExpr = Annotated[
    Union[Int, Str],  # noqa: UP007 (pydantic's JSON schema reads Union well)
    Field(description="A size expression: integers, size names, + - * /, parentheses"),
]


class DType(str, Enum):
    bf16 = "bf16"
    f16 = "f16"
    f32 = "f32"
    i32 = "i32"
    i64 = "i64"
    fp8e4m3 = "fp8e4m3"
    fp8e5m2 = "fp8e5m2"

    @property
    def is_float(self) -> bool:
        return self in (DType.bf16, DType.f16, DType.f32, DType.fp8e4m3, DType.fp8e5m2)

    @property
    def computes(self) -> bool:
        """A float the ops compute on (a sum's or a merge's operand); fp8e5m2 is no
        operand (a cast reads it; an op computes into it: ``is_float``), it moves bit for
        bit where an integer moves (docs/language.md, "Buffers")."""
        return self.is_float and self != DType.fp8e5m2

    @property
    def is_fp8(self) -> bool:
        """An fp8 format (dcpc.numerics.FP8_FORMATS): a computed one goes through
        ``output_scale``, a cast through ``scale``."""
        return self.value in FP8_FORMATS

    @property
    def itemsize(self) -> int:
        return {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "fp8e4m3": 1,
                "fp8e5m2": 1}[self.value]


class Streams(str, Enum):
    per_slot = "per_slot"
    single = "single"


class Peers(str, Enum):
    """Which peers a split-phase signal goes to (or a wait comes from); ``self``: the
    rank itself (its own flag: a signal on its own slot, a wait polling it)."""

    all = "all"
    next = "next"
    prev = "prev"
    self = "self"


def _lse_base(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


LseBase = Annotated[Literal["e", "2"], Field(description="Base of an LSE: e or 2")]


class Node(BaseModel):
    """Base of every model: unknown keys are errors; source marks are kept."""

    model_config = ConfigDict(extra="forbid")

    src_mark: SkipJsonSchema[Mark | None] = Field(default=None, alias=MARK, exclude=True)
    src_marks: SkipJsonSchema[dict[str, Mark]] = Field(
        default_factory=dict, alias=MARKS, exclude=True
    )

    def mark(self, key: str | None = None, *, of_key: bool = False) -> Mark:
        """Mark of this node, of the value of ``key``, or (of_key) of the key itself."""
        if key is not None:
            found = self.src_marks.get(("key:" if of_key else "") + key)
            if found is not None:
                return found
        return self.src_mark or NOWHERE


class SizeSpec(Node):
    """A size bound at run time (``max``) or at construction (``multiple_of``)."""

    max: Int | None = Field(default=None, ge=1, description="bound per call, up to this")
    multiple_of: SizeExpr | None = Field(
        default=None, description="bound at construction; must be a multiple of this"
    )

    @model_validator(mode="after")
    def _one_of(self) -> SizeSpec:
        if self.max is None and self.multiple_of is None:
            raise ValueError("a size needs 'max' or 'multiple_of' (or is a plain integer)")
        return self


def bound_buffer(end: Any, buffers: Mapping[str, Any] | set[str]) -> str | None:
    """The buffer an end of ``values`` names (``max: n_send``: read elementwise, its
    shape a prefix of the bounded buffer's), or None: a size expression. One definition
    for the unroller (its slices' names), the checker and ``dcpc run``'s draws."""
    text = end.strip() if isinstance(end, str) else None
    return text if text is not None and text.isidentifier() and text in buffers else None


class ValueRange(Node):
    """The values an integer buffer holds, both ends included (``values: {min: 0,
    max: W*L - 1}``: expert ids); each end a size expression, or the name of an integer
    buffer read elementwise (``max: n_send``: ``bound_buffer``)."""

    min: SizeExpr = Field(description="the smallest value, a size expression or a buffer")
    max: SizeExpr = Field(description="the largest value, a size expression or a buffer")
    distinct: Bool = Field(
        default=False, description="no value twice in the buffer (an index an external step "
        "writes rows by: docs/language.md, rows by values); drawn so by `dcpc run`")

    def buffers(self, buffers: Mapping[str, Any] | set[str]) -> dict[str, str]:
        """``{end: buffer}`` for the ends that name a buffer (``bound_buffer``)."""
        found = {end: bound_buffer(getattr(self, end), buffers) for end in ("min", "max")}
        return {end: name for end, name in found.items() if name is not None}


class Buffer(Node):
    # a 1-d slot's chunk (``n[s][m]``): the unroller's 0-d view, the one shape [] taken
    element: SkipJsonSchema[bool] = Field(default=False, alias=ELEMENT, exclude=True)
    shape: list[SizeExpr] = Field(description="dimensions, outermost first",
                                  json_schema_extra={"minItems": 1})
    dtype: DType
    values: ValueRange | None = Field(
        default=None, description="an integer buffer's values, both ends included"
    )
    symmetric: Bool = Field(
        default=False, description="allocated by the module in symmetric memory, per slot"
    )
    shared: Bool = Field(
        default=False, description="symmetric, one instance for all slots"
    )
    persist: Bool = Field(
        default=False,
        description="module-owned, one instance for all slots, its contents carried from "
        "call to call (zeros at construction)",
    )
    lse_base: LseBase | None = Field(default=None, description="marks an LSE buffer")
    doc: Str | None = None

    _norm_base = field_validator("lse_base", mode="before")(_lse_base)

    @field_validator("shape")
    @classmethod
    def _one_axis_or_more(cls, shape: list[Any], info: Any) -> list[Any]:
        # a declared buffer has an axis (pydantic's own too_short, as min_length gave it)
        if not shape and not info.data.get("element"):
            raise PydanticCustomError(
                "too_short", "List should have at least 1 item after validation, not 0")
        return shape

    @model_validator(mode="after")
    def _persist_one_instance(self) -> Buffer:
        # a persistent symmetric buffer is one instance for all slots: shared
        if self.persist and self.symmetric:
            self.shared = True
        return self

    @property
    def is_symmetric(self) -> bool:
        return self.symmetric or self.shared


class MaskEmpty(Node):
    """Mask partials of ranks whose KV shard is empty, and CUDA-graph padding rows.

    Either ``seq_lens`` (full lengths [B]; rank p holds the tokens t with
    (t // interleave) % W == p) or ``local_seq_lens`` (every rank's own lengths [B, W],
    as vLLM's get_dcp_local_seq_lens(seq_lens, W) gives them)."""

    seq_lens: Name | None = None
    local_seq_lens: Name | None = Field(
        default=None, description="[B, W] i32: rank p's KV tokens of request b"
    )
    query_start_loc: Name
    interleave: Int = Field(default=1, ge=1, description="KV interleave size I")

    @model_validator(mode="after")
    def _one_of(self) -> MaskEmpty:
        if (self.seq_lens is None) == (self.local_seq_lens is None):
            raise ValueError("mask_empty needs exactly one of 'seq_lens' (full lengths [B]) "
                             "and 'local_seq_lens' (every rank's lengths [B, W])")
        if self.local_seq_lens is not None and "interleave" in self.model_fields_set:
            raise ValueError("'interleave' applies to full 'seq_lens'; 'local_seq_lens' "
                             "already says what each rank holds")
        return self

    @property
    def lengths(self) -> str:
        """The buffer of lengths, full or local."""
        return self.seq_lens if self.seq_lens is not None else self.local_seq_lens  # type: ignore[return-value]

    @property
    def lengths_key(self) -> str:
        return "seq_lens" if self.seq_lens is not None else "local_seq_lens"


# the key under which the unroller puts a step copy's ``OwnerCopy`` (``OpBase.src_copy``)
OWNER_COPY = "__copy__"


@dataclass(frozen=True)
class OwnerCopy:
    """What a copy the unroller made of a step whose index names the rank came from
    (dcpc.lang.loops): the step as written, the first rank the copy runs on (its name
    is ``<step>[_<hop>...]_r<rank>``, never parsed back) and the name the index writes
    the rank by (``r`` or a mesh coordinate); ``why``: why that index is no rotation of
    the rank (``_Unroller._no_rotation``), "" when not said."""

    step: str
    rank: int
    index: str
    why: str = ""


class OpBase(Node):
    doc: Str | None = None
    # set by the unroller only (a schedule cannot write it): the step this one is a
    # rank's copy of; None: the step as written (or a hop's copy of it)
    src_copy: SkipJsonSchema[OwnerCopy | None] = Field(default=None, alias=OWNER_COPY,
                                                       exclude=True)
    # a condition on the rank (and hop): the step runs only where it holds
    # (dcpc.lang.when; a step that runs on its rank alone)
    when: Str | None = Field(default=None,
                             description="run only where this holds, e.g. 'h <= rank'")
    # the mesh axes a communication op runs over (dcpc.lang.mesh); None: every axis
    axis: Str | Annotated[list[Str], Field(min_length=1)] | None = None


class Step:
    """A named step: ``name`` plus its op model (not a pydantic model itself)."""

    __slots__ = ("name", "op", "index")

    def __init__(self, name: str, op: OpBase, index: int):
        self.name, self.op, self.index = name, op, index

    @property
    def kind(self) -> str:
        return self.op.op  # type: ignore[attr-defined]

    def mark(self) -> Mark:
        return self.op.mark("__name__")

    def __repr__(self) -> str:
        return f"Step({self.name!r}, {self.kind})"


class ScheduleView(Protocol):
    """What the ops and the mesh read of a schedule (``dcpc.lang.model.Schedule`` is
    one): typed here, below the ops, so that no op imports the model that assembles
    them."""

    @property
    def buffers(self) -> Mapping[str, Buffer]: ...

    @property
    def mesh(self) -> Mapping[str, int | str] | None: ...

    @property
    def sizes(self) -> Mapping[str, Any]: ...

    def step_list(self) -> list[Step]: ...

    def slice_of(self, name: str) -> tuple[str, int] | None: ...

    def cells(self, name: str) -> list[str]: ...


def int_sizes(schedule: ScheduleView) -> dict[str, int]:
    """The sizes declared as plain integers."""
    return {k: v for k, v in schedule.sizes.items()
            if isinstance(v, int) and not isinstance(v, bool)}
