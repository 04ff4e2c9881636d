"""The schedule language as pydantic v2 models.

Models validate types and keys only; cross-references, shapes and ordering are the
check stage's job (so that every error of a file is reported in one run). Every
model keeps the source marks that ``dcpc.lang.yamlsrc`` put into the data.

The building blocks are in ``dcpc.lang.nodes``; each op's model is defined with the
rest of the op in ``dcpc.ops`` (one module per op) and re-exported here, so that
``model.AllGather`` and friends keep their names.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from dcpc.lang.nodes import (  # noqa: F401  (re-exported: the language's public names)
    Bool,
    Buffer,
    DType,
    Int,
    LseBase,
    MaskEmpty,
    Name,
    Node,
    OpBase,
    Peers,
    SizeExpr,
    SizeSpec,
    Step,
    Str,
    Streams,
    ValueRange,
)
from dcpc.lang.yamlsrc import MARK, MARKS
from dcpc.ops import OP_NAMES, OPS  # noqa: F401  (OP_NAMES re-exported)

# each op's class under its public name (model.AllGather), read from the registry: an op's
# module defines it once and no line here names it
globals().update({d.model.__name__: d.model for d in OPS.values()})

Op = Annotated[
    Union[tuple(d.model for d in OPS.values())],  # type: ignore[valid-type]  # noqa: UP007
    Field(discriminator="op"),
]

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


MAX_SLOTS = 64  # slots: independent workspaces (docs/language.md, "Limits")
MAX_BUFFERS = 256  # buffers, an indexed one counted per slice (docs/language.md, "Limits")


class Schedule(Node):
    """One schedule file: what ONE rank of the group does in a call (SPMD)."""

    schedule: Str = Field(description="identifier; the module is <schedule>.py")
    doc: Str | None = Field(default=None, description="free text, the module's docstring")
    slots: Int = Field(default=1, ge=1, le=MAX_SLOTS, description="independent workspaces")
    streams: Streams = Field(default=Streams.per_slot)
    mesh: dict[str, Union[Int, Str]] | None = Field(  # noqa: UP007
        default=None, description="axes outermost first, each sized by a size name or an int")
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
        for table in ("sizes", "buffers", "mesh"):
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
    # the W a loop whose trip count names W was unrolled for (dcpc.lang.loops), its mesh
    # shape when the unrolling names a mesh axis' size, or None
    _loop_world: int | tuple[int, ...] | None = PrivateAttr(default=None)

    # the buffers used both whole and by slice (dcpc.lang.loops): the engine's, or a
    # later axis of the module's memory (``b[:, k]``, a slot's chunks ``b[s][:, k]``:
    # the slot 'b_<s>'): buffer -> its slice count; slice k is the buffer
    # '<name>_<k>', a view of index k of it
    _slices: dict[str, int] = PrivateAttr(default_factory=dict)
    # of those, the ones sliced along a later axis (``b[:, k]``): buffer -> that axis
    _slice_axes: dict[str, int] = PrivateAttr(default_factory=dict)
    # the slots whose chunks are taken (``b[s][:, k]``): slot 'b_<s>' -> 'b[<s>]', as
    # the file writes it
    _slot_text: dict[str, str] = PrivateAttr(default_factory=dict)
    # every buffer the loops index (``n[c]``: used only by slice, or whole too as in
    # ``_slices``): buffer -> its slice count
    _sliced: dict[str, int] = PrivateAttr(default_factory=dict)

    @property
    def loop_world(self) -> int | tuple[int, ...] | None:
        return self._loop_world

    @property
    def slices(self) -> dict[str, int]:
        return self._slices

    @property
    def sliced(self) -> dict[str, int]:
        """Every buffer the loops index, used only by slice (its slices '<name>_<k>'
        are buffers of their own, the name none) or whole too (``slices``)."""
        return self._sliced

    def view(self, whole: str, value: Any, k: int) -> Any:
        """Slice ``k`` of buffer ``whole`` (used whole and by slice) in its tensor
        ``value``: index k of its leading axis, or of the axis its indices slice
        (``b[:, k]``: ``value.select(1, k)``), a view that writes through. A slot's
        chunk (``recv[s][:, k]``) is such a slice of the slot ``recv_<s>``, whose
        tensor is then the module's memory (dcpc.harness.worker.module_view)."""
        return value.select(self.slice_axis(whole), k)

    def slice_axis(self, whole: str) -> int:
        """The axis buffer ``whole`` (used whole and by slice) is sliced along: 0, or the
        later axis its indices name (``b[:, k]``: 1; a slot's chunk ``b[s][:, k]``: 1 of
        the slot ``b_<s>``)."""
        return self._slice_axes.get(whole, 0)

    def slice_text(self, name: str) -> str | None:
        """How the file writes slice ``name`` of a buffer used whole and by slice:
        ``'q[1]'``, ``'q[:, 1]'`` (one sliced along axis 1), or None."""
        part = self.slice_of(name)
        if part is None:
            return None
        whole = self._slot_text.get(part[0], part[0])
        return f"{whole}[{':, ' * self.slice_axis(part[0])}{part[1]}]"

    def slice_of(self, name: str) -> tuple[str, int] | None:
        """(whole buffer, index) when ``name`` is a view of a buffer used whole too."""
        head, _, index = name.rpartition("_")
        if head in self._slices and index.isdigit() and int(index) < self._slices[head]:
            return head, int(index)
        return None

    def module_view_of(self, name: str) -> str | None:
        """The buffer of the module's memory (symmetric or shared: ``Buffer.is_symmetric``)
        ``name`` is a view of (``b[:, k]``, a slot's chunk ``b[s][:, k]``: the slot), or
        None: the one rule the codegen, the checker, the worker and the test oracle use."""
        part = self.slice_of(name)
        return part[0] if part is not None and self.buffers[part[0]].is_symmetric else None

    def cells(self, name: str) -> list[str]:
        """The buffers an access of ``name`` touches as the data flow sees them: the
        slices of a buffer used whole and by slice, else ``name`` itself."""
        if name in self._slices:
            return [f"{name}_{k}" for k in range(self._slices[name])]
        return [name]

    @property
    def source_file(self) -> str:
        return self._source_file

    @property
    def source_sha256(self) -> str:
        return self._source_sha256

    def set_source(self, file: str, sha256: str) -> None:
        self._source_file, self._source_sha256 = file, sha256

    def method_outputs(self) -> set[str]:
        """The buffers a method (a step that is not external) writes as its ``dst`` or
        ``return_lse``: a local one of these is the module's own (dcpc.codegen.lower's
        "output"), every other local buffer the engine's."""
        written: set[str] = set()
        for step in self.step_list():
            if step.kind != "external":
                for key in ("dst", "return_lse"):
                    value = getattr(step.op, key, None)
                    written.update(v for v in (value if isinstance(value, list) else [value])
                                   if v is not None)
        return written

    def step_list(self) -> list[Step]:
        """Every step in program order; ``index`` is its position in this list.

        An item that is empty or holds two steps is the checker's ``bad-step``; the
        numbering stays consecutive anyway, so no stage indexes past the end of a
        per-step table while the error is being reported.
        """
        named = [(name, op) for item in self.steps for name, op in item.items()]
        return [Step(name, op, i) for i, (name, op) in enumerate(named)]
