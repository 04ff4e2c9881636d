"""The schedule language as pydantic v2 models.

Models validate types and keys only; cross-references, shapes and ordering are the
check stage's job (so that every error of a file is reported in one run). Every
model keeps the source marks that ``dcpc.lang.yamlsrc`` put into the data.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from dcpc.diagnostics import NOWHERE, Mark
from dcpc.lang.yamlsrc import MARK, MARKS

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Name = Annotated[str, Strict(), Field(description="A name declared under buffers")]
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

    @property
    def is_float(self) -> bool:
        return self in (DType.bf16, DType.f16, DType.f32, DType.fp8e4m3)

    @property
    def itemsize(self) -> int:
        return {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "fp8e4m3": 1}[self.value]


class Streams(str, Enum):
    per_slot = "per_slot"
    single = "single"


class Peers(str, Enum):
    """Which peers a split-phase signal goes to (or a wait comes from)."""

    all = "all"
    next = "next"
    prev = "prev"


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


class Buffer(Node):
    shape: list[SizeExpr] = Field(min_length=1, description="dimensions, outermost first")
    dtype: DType
    symmetric: Bool = Field(
        default=False, description="allocated by the module in symmetric memory, per slot"
    )
    shared: Bool = Field(
        default=False, description="symmetric, one instance for all slots"
    )
    lse_base: LseBase | None = Field(default=None, description="marks an LSE buffer")
    doc: Str | None = None

    _norm_base = field_validator("lse_base", mode="before")(_lse_base)

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


class OpBase(Node):
    doc: Str | None = None


class AllGather(OpBase):
    op: Literal["all_gather"]
    src: Name
    dst: Name
    dim: Int = 0
    interleave: Int | None = Field(default=None, ge=1)


class AllToAll(OpBase):
    op: Literal["all_to_all"]
    src: Name | list[Name]
    dst: Name | list[Name]
    dim: Int = 0


class LseCombine(OpBase):
    op: Literal["lse_combine"]
    src: list[Name] = Field(min_length=2, max_length=2, description="[o, lse]")
    dst: Name
    mask_empty: MaskEmpty | None = None
    return_lse: Name | None = Field(default=None, description="buffer for the merged LSE")
    lse_base: LseBase | None = None
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )

    _norm_base = field_validator("lse_base", mode="before")(_lse_base)


class AllToAllCombine(OpBase):
    """Fused all_to_all + lse_combine: push, signal, wait and merge in one kernel."""

    op: Literal["all_to_all_combine"]
    src: list[Name] = Field(min_length=2, max_length=2, description="[o, lse]")
    via: list[Name] = Field(min_length=2, max_length=2, description="[o_recv, lse_recv]")
    dst: Name
    dim: Int = 0
    mask_empty: MaskEmpty | None = None
    return_lse: Name | None = None
    lse_base: LseBase | None = None
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )

    _norm_base = field_validator("lse_base", mode="before")(_lse_base)


class ReduceScatter(OpBase):
    op: Literal["reduce_scatter"]
    src: Name
    dst: Name
    dim: Int = 0
    via: Name | None = Field(
        default=None, description="symmetric receive buffer [W, part]; implicit if omitted"
    )
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )


class LseCorrect(OpBase):
    op: Literal["lse_correct"]
    src: list[Name] = Field(min_length=2, max_length=2, description="[o, lse_all]")
    dst: Name
    mask_empty: MaskEmpty | None = None
    return_lse: Name | None = None


class Copy(OpBase):
    """A local copy into a buffer of the same shape (the staging path's materialization)."""

    op: Literal["copy"]
    src: Name
    dst: Name


class Barrier(OpBase):
    op: Literal["barrier"]


class Signal(OpBase):
    """Split-phase sync: publish this step's epoch to peers (no wait)."""

    op: Literal["signal"]
    to: Peers = Peers.all
    channel: Name


class Wait(OpBase):
    """Split-phase sync: wait for the matching signal of peers on a channel."""

    op: Literal["wait"]
    from_: Peers = Field(default=Peers.all, alias="from")
    channel: Name


class External(OpBase):
    op: Literal["external"]
    reads: list[Name] = Field(default_factory=list)
    writes: list[Name] = Field(default_factory=list)


Op = Annotated[
    Union[  # noqa: UP007
        AllGather,
        AllToAll,
        LseCombine,
        AllToAllCombine,
        ReduceScatter,
        LseCorrect,
        Copy,
        Barrier,
        Signal,
        Wait,
        External,
    ],
    Field(discriminator="op"),
]

OP_NAMES = (
    "all_gather", "all_to_all", "lse_combine", "all_to_all_combine", "reduce_scatter",
    "lse_correct", "copy", "barrier", "signal", "wait", "external",
)


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


def _split_step_items(items: Any) -> Any:
    """``[{name: body}]`` -> the same list with marks moved into the bodies."""
    if not isinstance(items, list):
        return items
    out = []
    for item in items:
        if isinstance(item, dict):
            marks = item.get(MARKS, {})
            body = {k: v for k, v in item.items() if k not in (MARK, MARKS)}
            for name, value in body.items():
                if isinstance(value, dict) and MARKS in value:
                    value[MARKS] = {**value[MARKS], "__name__": marks.get("key:" + name)}
            out.append(body)
        else:
            out.append(item)
    return out


class Schedule(Node):
    """One schedule file: what ONE rank of the group does in a call (SPMD)."""

    schedule: Str = Field(description="identifier; the module is <schedule>.py")
    doc: Str | None = Field(default=None, description="free text, the module's docstring")
    slots: Int = Field(default=1, ge=1, le=64, description="independent workspaces")
    streams: Streams = Field(default=Streams.per_slot)
    sizes: dict[str, Union[Int, SizeSpec]] = Field(default_factory=dict)  # noqa: UP007
    buffers: dict[str, Buffer] = Field(min_length=1)
    steps: list[dict[str, Op]] = Field(min_length=1)

    _split = field_validator("steps", mode="before")(_split_step_items)

    @model_validator(mode="before")
    @classmethod
    def _lift_name_marks(cls, data: Any) -> Any:
        """Move the marks of the ``sizes`` and ``buffers`` mappings up to the schedule.

        Their keys are names, not model fields: ``mark("buffers/q_full", of_key=True)``
        gives the mark of a buffer's name, ``mark("sizes/T")`` the mark of a size.
        """
        if not isinstance(data, dict):
            return data
        data = dict(data)
        marks = dict(data.get(MARKS, {}))
        for table in ("sizes", "buffers"):
            value = data.get(table)
            if isinstance(value, dict) and MARKS in value:
                for key, mark in value[MARKS].items():
                    # "key:NAME" (the mark of the key) or "NAME" (of its value); a
                    # name may itself hold ':' (reported as a bad identifier, here)
                    prefix = "key:" if key.startswith("key:") else ""
                    marks[f"{prefix}{table}/{key[len(prefix):]}"] = mark
                data[table] = {k: v for k, v in value.items() if k not in (MARK, MARKS)}
        data[MARKS] = marks
        return data

    # filled by parse(): the file the schedule came from and its text's hash. Private
    # attributes, so that no YAML key can set them.
    _source_file: str = PrivateAttr(default="<memory>")
    _source_sha256: str = PrivateAttr(default="")

    @property
    def source_file(self) -> str:
        return self._source_file

    @property
    def source_sha256(self) -> str:
        return self._source_sha256

    def set_source(self, file: str, sha256: str) -> None:
        self._source_file, self._source_sha256 = file, sha256

    def step_list(self) -> list[Step]:
        """Every step in program order; ``index`` is its position in this list.

        An item that is empty or holds two steps is the checker's ``bad-step``; the
        numbering stays consecutive anyway, so no stage indexes past the end of a
        per-step table while the error is being reported.
        """
        named = [(name, op) for item in self.steps for name, op in item.items()]
        return [Step(name, op, i) for i, (name, op) in enumerate(named)]
