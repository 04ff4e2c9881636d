"""Hop loops: a ``repeat`` step is unrolled into plain steps before the model is built.

    - ring:
        repeat: W - 1          # trip count: an expression of W and integer sizes
        as: h                  # the hop index
        steps:
          - send: {op: shift, src: "kv[h % 2]", dst: "kv[(h + 1) % 2]", phase: put}

Hop ``h`` of inner step ``send`` becomes the step ``send_h<h>``; every step of hop h
comes before every step of hop h + 1. A loop's steps may hold a loop (at most MAX_NEST
deep), with its own hop index: hop ``g`` of a step ``send`` inside hop ``h`` becomes
``send_h<h>_<g>``; an inner trip count, index or offset may name every enclosing index
(``repeat: h + 1``). A trip count is an expression of W, the mesh's axis sizes, the
enclosing hop indices and integer sizes. A buffer index ``b[e]`` (in a loop or not) names
slice ``e`` of ``b``'s leading axis, which must be an integer P; ``e`` is an expression
of the hop index, W and integer sizes, and its value lies in 0..P-1. ``%`` takes an
integer constant on its right and everything on its left up to the enclosing ``(`` or
the index's start: ``h % 2``, ``(h + 1) % 2``, ``2 * (h % 2) + 1``, not ``h % 2 + 1``.
A buffer used with an index is split into P buffers ``b_0`` .. ``b_{P-1}`` of shape
``shape[1:]`` (disjoint slices, so the split is exact); it may not also be used whole.
An index that names the rank is unrolled into one guarded copy of its step per group of
ranks whose slices agree (``_Unroller.owned``), except a ROTATION of the rank on a
symmetric buffer whose leading axis is W, written as one (``r``, ``(r + E) % W``,
``(r - E) % W``, ``(E + r) % W``: ``_rotation_offset``, c = E mod W, no rank evaluated),
the buffer indexed no other way (``_rotation_uses``): that is the buffer ``b_rot<c>``,
slot (r + c) mod W of b on rank r, one step every rank runs (``_Unroller._rotated``), so
a communication step may take it.
A shift's ``offset`` (in a loop or not) may be such an expression too, without ``%``
(``W / 2``, ``h + 1``): it is replaced by its integer value here, so every later stage
sees an integer offset. So may an all_gather's ``interleave`` (``C``, ``H / HK``).

Every later stage sees a flat schedule, so each one handles loops without a rule of its
own: a step of hop h owns its own signal slots, and the k-th wait of a channel polls
its k-th signal, so the wait of hop h is satisfied by the signal of hop h. The price:
a trip count (or an index, an offset or an interleave) that depends on W gives a
schedule per W, so such a file is checked once per W of ``--world`` (no claim past them)
and its module holds one class per W (dcpc.codegen.emit.emit_worlds); one that names
a mesh axis' size (``G - 1`` on ``mesh: {node: N, gpu: G}``) gives a schedule per mesh
shape, so its module serves that shape only (LOOP_WORLD is the shape).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable
from typing import Any

from dcpc.diagnostics import Diagnostic, DiagnosticError, Mark, clipped, did_you_mean
from dcpc.lang import expr as ex
from dcpc.lang.expr import OWNER
from dcpc.lang.mesh import Mesh
from dcpc.lang.nodes import ELEMENT, OWNER_COPY, OwnerCopy, bound_buffer
from dcpc.lang.when import OWNER_MARK, RANK
from dcpc.lang.yamlsrc import MARK, MARKS, MAX_STEPS  # MAX_STEPS: the language's step bound
from dcpc.ops import _perm as perms
from dcpc.ops import all_gather, shift, sync
from dcpc.ops import ragged_all_to_all as ragged
from dcpc.ops.external import ROWS
from dcpc.topology import ROTATION, rotations, shape_of, torus  # noqa: F401 (rotations: re-exported)

MAX_SLICES = 64  # slices of one indexed buffer: each becomes a buffer of its own
# the key under which the unrolled data names the engine-owned buffers used both whole and
# by slice (buffer -> its slice count); dcpc.lang.parse moves it to Schedule.slices
SLICES = "__slices__"
MAX_NEST = 3  # loops nest at most this deep (a loop in a loop in a loop)
# hops of every loop, an inner loop's counted once per outer hop: what bounds the work of
# a nest whose hops unroll to no step (an inner 'repeat: 0'), which the step bound misses
MAX_HOPS = 4 * MAX_STEPS
LOOP_KEYS = ("repeat", "as", "steps", "doc", "when")
_INDEXED = re.compile(r"([a-z][a-z0-9_]*)\[(.*)\]\Z", re.S)
# a step's keys whose values name no buffer slice (what a rotation's renaming skips)
_NOT_SLICES = frozenset({MARK, MARKS, "op", "doc", "when", "perm", "offset", "interleave",
                         "shard", "channel", "from", "to", "phase"})
_IDENT = re.compile(r"[a-z][a-z0-9_]*\Z")
# the unrolled data's key for the axis each buffer used whole and by slice is sliced
# along, where it is not the leading one (buffer -> axis): Schedule.view takes it
SLICE_AXES = "__slice_axes__"
# the slots whose chunks are taken (``b[s][:, k]``), as the file writes them (slot 'b_<s>'
# -> 'b[<s>]'): Schedule.slice_text names a chunk with it
SLOT_TEXT = "__slot_text__"
# every buffer the loops index (buffer -> its slice count), used only by slice or whole
# too: Schedule.sliced (a ``values`` end naming one the steps use only by slice)
SPLIT = "__split__"


def _plain(shape: list[Any]) -> str:
    """A shape as a file writes it: ``['B', 2, 'C']`` -> ``'[B, 2, C]'``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def index_axis(inner: str) -> tuple[int, str] | None:
    """An index's text -> (the axis it slices, its expression): ``'h % 2'`` -> (0,
    ``'h % 2'``), ``':, 1'`` -> (1, ``'1'``), ``':, :, e'`` -> (2, ``'e'``): leading
    ``:`` entries, then one expression. None when entries before the last are not all
    ``:`` (``'1, :'``) or the last is one (``':, :'``): no slice of one axis. Text of two
    indices (``'h % 2][:, 0'``, a slot's chunk: ``_Unroller._chunk``) is the leading
    axis' as it is."""
    if "[" in inner:  # two indices ('i][j'): the leading axis' text, refused later
        return 0, inner
    parts = inner.split(",")
    if len(parts) == 1:
        return 0, inner
    if any(p.strip() != ":" for p in parts[:-1]) or parts[-1].strip() in ("", ":"):
        return None
    return len(parts) - 1, parts[-1].strip()


def _index_expr(inner: str) -> str:
    """The expression of an index (its ``:`` entries dropped; the text as is when it is
    no slice of one axis)."""
    chunk = _CHUNK.match(inner)
    if chunk:  # a slot's chunk: both expressions (the names they use)
        later = index_axis(chunk.group(2))
        return f"({chunk.group(1)}) + ({chunk.group(2) if later is None else later[1]})"
    found = index_axis(inner)
    return inner if found is None else found[1]


# rows by values ``b[idx]`` / ``b[e][idx]`` (``_Unroller._rows``): a buffer, an optional
# slot index, then a name (a buffer's, when it is declared)
_ROWS = re.compile(r"([a-z][a-z0-9_]*)(?:\[([^\[\],:]*)\])?\[\s*([a-z][a-z0-9_]*)\s*\]\Z", re.S)


def _place(op: str | None, key: str | None) -> str:
    """Where a rows access stands, for ``_Unroller._rows``'s refusal."""
    if op != "external":
        return f"a step of op '{op}'"
    return f"key '{key}' of an external step" if key else "an external step's key"


def _buffer_names(data: Any) -> set[str]:
    buffers = data.get("buffers") if isinstance(data, dict) else None
    return set(buffers) if isinstance(buffers, dict) else set()


# a slot's chunk ``b[e1][:, e2]`` (``b[e1][e2]``: along the slot's axis 0, of a buffer of
# the module's memory only): the slot's index, then the chunk's
_CHUNK = re.compile(r"([^\[\]]*)\]\[([^\[\]]*)\Z", re.S)


def _spec(buffers: Any, name: str) -> dict[str, Any]:
    """Buffer ``name``'s declaration in the data's ``buffers`` ({}: none, or malformed)."""
    spec = buffers.get(name) if isinstance(buffers, dict) else None
    return spec if isinstance(spec, dict) else {}


def _shape(buffers: Any, name: str) -> list[Any] | None:
    """The declared shape of buffer ``name`` in the data's ``buffers`` (None: none)."""
    shape = _spec(buffers, name).get("shape")
    return shape if isinstance(shape, list) else None


def _body(item: Any) -> tuple[str, Any] | None:
    if not isinstance(item, dict):
        return None
    named = [(k, v) for k, v in item.items() if k not in (MARK, MARKS)]
    return named[0] if len(named) == 1 else None


def _guarded(op: dict[str, Any], loop: dict[str, Any], file: str) -> dict[str, Any]:
    """A step (or loop) inside ``loop`` with the loop's ``when:`` conjoined with its own
    (a loop's guard guards every step inside); the step's own mark stays, else the
    loop's. The loop's own is a condition by now (``_Unroller._loop_when`` refused and
    dropped any other); a step's own that is not a string is left to the step's check."""
    cond = loop.get("when")
    if cond is None:
        return op
    own = op.get("when")
    marks = dict(op.get(MARKS, {}))
    if own is None:
        marks["when"] = _mark(loop, "when", file)
    both = cond if own is None else (f"({cond}) and ({own})"
                                    if isinstance(cond, str) and isinstance(own, str)
                                    else own)
    return {**op, "when": both, MARKS: marks}


def _is_loop(body: Any) -> bool:
    return isinstance(body, dict) and "repeat" in body and "op" not in body


def loops(data: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, body) of every loop step of the raw schedule data."""
    steps = data.get("steps") if isinstance(data, dict) else None
    found = []
    for item in steps if isinstance(steps, list) else []:
        named = _body(item)
        if named and _is_loop(named[1]):
            found.append(named)
    return found


def _mark(node: dict[str, Any], key: str | None, file: str) -> Mark:
    if key is not None and key in node.get(MARKS, {}):
        return node[MARKS][key]
    return node.get(MARK) or Mark(file, 1, 1)


def _int_sizes(data: dict[str, Any]) -> dict[str, int]:
    sizes = data.get("sizes")
    if not isinstance(sizes, dict):
        return {}
    return {k: v for k, v in sizes.items() if isinstance(v, int) and not isinstance(v, bool)
            and k not in (MARK, MARKS)}


def _axis_sizes(data: Any) -> dict[str, int]:
    """Size name -> mesh axis position, for the raw ``mesh:`` axes sized by a name (the
    checker reports a broken mesh; nothing is bound from one)."""
    mesh = data.get("mesh") if isinstance(data, dict) else None
    if not isinstance(mesh, dict):
        return {}
    axes = {k: v for k, v in mesh.items() if k not in (MARK, MARKS)}
    return Mesh(tuple(axes), tuple(axes.values()), True).size_names()


def world_names(data: Any) -> set[str]:
    """The names whose value a group size gives: W and the mesh's axis sizes."""
    return {"W", *_axis_sizes(data)}


def _names_w(text: Any, names: frozenset[str] | set[str] = frozenset({"W"})) -> bool:
    if not isinstance(text, str):
        return False
    try:
        # '%' and '*' bind the same names; the parser reads '*' only
        return bool(names & ex.symbols(ex.parse(text.replace("%", "*"))))
    except ex.ExprSyntaxError:
        return False


# the ops whose ``offset``/``perm`` name a peer (a shift's push, a credit's signal/wait)
_PEERED = frozenset({shift.DEF.name, sync.SIGNAL.name, sync.WAIT.name,
                     ragged.DEF.name})
# what an op with an offset does by it, and what an offset of 0 (mod W) would make it
# do: the unroller's offset messages name the op by these
_BY_OFFSET = {shift.DEF.name: ("shifts", "sends every rank's data to itself"),
              sync.SIGNAL.name: ("signals", "signals every rank itself"),
              sync.WAIT.name: ("waits", "waits for every rank itself"),
              ragged.DEF.name: ("sends to one peer", None)}  # 0: its own slots


def _offset_expr(body: Any) -> str | None:
    """A shift's (or a signal's, a wait's) ``offset`` when it is an expression (not an
    integer, next or prev): the unroller evaluates it."""
    if not _peered(body):
        return None
    offset = body.get("offset")
    return offset if isinstance(offset, str) and offset not in shift.NAMED else None


def _perm(body: Any) -> Any:
    """A shift's (or a signal's, a wait's) ``perm`` (any form; None without one): the
    unroller turns it into the destination table at each W, so a perm makes the file one
    schedule per W (a ragged_all_to_all takes an offset only: its perm is an unknown key)."""
    if not _peered(body) or body["op"] == ragged.DEF.name:
        return None
    return body.get("perm")


def _peered(body: Any) -> bool:
    """Whether ``body`` is a step whose op names one peer by an offset or a perm (any
    value of ``op``, a list from a hostile file too, is looked at safely)."""
    return isinstance(body, dict) and isinstance(body.get("op"), str) \
        and body["op"] in _PEERED


def _team_w(body: Any, data: Any) -> str | int | None:
    """What sizes the team of a shift step along one axis of a mesh of several axes
    (``axis: gpu``): that axis' size name or integer, which W in its offset names (the
    team size replaces W, as in every team op's shape rules); None otherwise."""
    mesh = data.get("mesh") if isinstance(data, dict) else None
    axis = body.get("axis") if isinstance(body, dict) else None
    if not isinstance(mesh, dict) or not isinstance(axis, str):
        return None
    axes = {k: v for k, v in mesh.items() if k not in (MARK, MARKS)}
    return axes[axis] if len(axes) > 1 and axis in axes else None


def _offset_names(body: Any, data: Any) -> str | None:
    """A shift's offset expression as it depends on the group size: W read as its
    team's size (``_team_w``)."""
    text, team = _offset_expr(body), _team_w(body, data)
    return text if text is None or team is None else re.sub(r"\bW\b", f"({team})", text)


def _coordinates(data: Any) -> set[str]:
    """The mesh's axis names: in an index, the rank's coordinate along that axis."""
    mesh = data.get("mesh") if isinstance(data, dict) else None
    return {k for k in mesh if k not in (MARK, MARKS)} if isinstance(mesh, dict) else set()


def _owner_names(data: Any) -> frozenset[str]:
    """What an index may name of the rank: ``r`` and, on a mesh, each axis' coordinate."""
    return frozenset({OWNER} | _coordinates(data))


def _shard(body: Any) -> Any:
    """An external step's ``shard`` (None without one): a rank, evaluated per rank and
    bounded at each W by the unroller, so it makes the file one schedule per W."""
    if not isinstance(body, dict) or body.get("op") != "external":
        return None
    return body.get("shard")


def _interleave_expr(body: Any) -> str | None:
    """An all_gather step's ``interleave`` when it is an expression (not an integer):
    the unroller evaluates it, as it does a shift's offset."""
    if not isinstance(body, dict) or body.get("op") != all_gather.DEF.name:
        return None
    value = body.get("interleave")
    return value if isinstance(value, str) else None


def world_dependent(data: Any) -> Mark | None:
    """Where the unrolled schedule first depends on the group size: a ``repeat`` whose
    trip count names W (or a mesh axis' size), a buffer index naming it, an index into a
    buffer whose leading axis names it, or a shift offset or a gather's interleave naming
    it (or None)."""
    return _first_naming(data, world_names(data))


def names_axis_size(data: Any) -> bool:
    """Whether the unrolled schedule depends on a mesh axis' size (not on W alone): it
    is then one schedule per mesh shape, not per W."""
    return _first_naming(data, set(_axis_sizes(data))) is not None


def loop_world(data: Any, world: int) -> int | tuple[int, ...]:
    """What a module unrolled at ``world`` serves (LOOP_WORLD): its mesh shape when the
    unrolling names an axis size of a mesh of several axes, else its W."""
    shape = shape_of(world)
    return shape if len(shape) > 1 and names_axis_size(data) else int(world)


def _first_naming(data: Any, names: set[str]) -> Mark | None:
    if not names:
        return None
    for _, body in loops(data):
        if _names_w(body.get("repeat"), names):
            return _mark(body, "repeat", "<memory>")
    buffers = data.get("buffers") if isinstance(data, dict) else None

    def sliced_w(name: str, inner: str) -> bool:  # an axis the index slices names W
        found = index_axis(inner)
        axes = [0 if found is None else found[0]]
        chunk = _CHUNK.match(inner)
        if chunk:  # a slot's chunk: the leading axis, and the slot's later one
            later = index_axis(chunk.group(2))
            axes.append(0 if later is None else later[0] + 1)
        shape = _shape(buffers, name)
        return shape is not None and any(len(shape) > a and _names_w(shape[a], names)
                                         for a in axes)

    def walk(node: Any, mark: Mark | None, hops: frozenset[str] = frozenset()) -> Mark | None:
        # a perm's table is one W's (on a mesh, one shape's: its ranks are the mesh's)
        if ("W" in names or names & set(_axis_sizes(data))) and _perm(node) is not None:
            return _mark(node, "perm", "<memory>")
        if _names_w(_offset_names(node, data), names):
            return _mark(node, "offset", "<memory>")
        if _names_w(_interleave_expr(node), names):
            return _mark(node, "interleave", "<memory>")
        if "W" in names and _shard(node) is not None:  # a rank: checked at each W
            return _mark(node, "shard", "<memory>")
        if _is_loop(node) and _names_w(node.get("repeat"), names):  # a nested loop's
            return _mark(node, "repeat", "<memory>")
        if _is_loop(node) and isinstance(node.get("as"), str):
            hops = hops | {node["as"]}
        if isinstance(node, dict):
            for key, value in node.items():
                if key not in (MARK, MARKS):
                    found = walk(value, node.get(MARKS, {}).get(key) or mark, hops)
                    if found is not None:
                        return found
        elif isinstance(node, list):
            for value in node:
                found = walk(value, mark, hops)
                if found is not None:
                    return found
        elif isinstance(node, str):
            indexed = _INDEXED.match(node.strip())
            # an index naming the rank is unrolled into one copy per rank group at each W
            # (a coordinate's at each mesh shape: the file is then one schedule per shape)
            owner = (({OWNER} if "W" in names else set())
                     | (_coordinates(data) if names & set(_axis_sizes(data)) else set())) - hops
            if indexed and (_names_w(_index_expr(indexed.group(2)), names | owner)
                            or sliced_w(indexed.group(1), indexed.group(2))):
                return mark
        return None

    return walk(data.get("steps"), None) if isinstance(data, dict) else None


def _world_env(data: Any, world: int | None) -> dict[str, int]:
    """The integer sizes, W and the mesh's axis sizes at ``world`` (its shape binds the
    axis sizes when it has as many axes as the mesh)."""
    env = dict(_int_sizes(data))
    if world is None:
        return env
    env["W"] = world
    axes = _axis_sizes(data)
    mesh = data.get("mesh") if isinstance(data, dict) else None
    shape = shape_of(world)
    if axes and isinstance(mesh, dict) and len(shape) == len(
            [k for k in mesh if k not in (MARK, MARKS)]):
        env.update({name: shape[at] for name, at in axes.items()})
    return env


class _Unroller:
    def __init__(self, data: dict[str, Any], file: str, world: int | None):
        self.data, self.file, self.world = data, file, world
        self.env = _world_env(data, world)
        self.axes = _axis_sizes(data)  # size name -> its mesh axis' position
        self.errors: list[Diagnostic] = []
        self.split: dict[str, int] = {}  # buffer -> P, for the buffers used with an index
        self.whole: dict[str, Mark] = {}  # buffer -> where it is used whole
        # buffer -> (the axis its indices slice, the first such index, where it is)
        self.axes_of: dict[str, tuple[int, str, Mark]] = {}
        self.step_op: str | None = None  # the op of the step ``op`` rewrites
        # rows by values (``_rows``) of the step ``op`` rewrites: the key being rewritten
        # ('reads', 'writes', ...), and buffer (or slot) -> (index buffer, key, text, where)
        self.step_key: str | None = None
        self.step_rows: dict[str, tuple[str, str, str, Mark]] = {}
        self.step_rows_count: dict[tuple[str, str | None], int] = {}  # (buffer, key) -> uses
        # a name written bare in a step that is not external -> (where, its op): a
        # later-axis slice's unrolled name '<b>_<k>' is refused there (_split_buffers)
        self.bare: dict[str, tuple[Mark, str]] = {}
        # a rotation of the rank's slice of a symmetric buffer (``_rotated``): its name ->
        # (buffer, c, where first used); ``fixed``: buffers left to copies per rank
        self.rotated: dict[str, tuple[str, int, Mark]] = {}
        self.fixed: set[str] = set()
        self.count = 0  # the steps unrolled so far (``loop``'s backstop)
        # a slot of a module-owned buffer whose chunks external steps read
        # (``b[e1][:, e2]``: ``_chunk``) -> (the slot's axis, first use, where, chunk
        # count, the slot as the file writes it: 'b[<e1>]')
        self.chunks: dict[str, tuple[int, str, Mark, int, str]] = {}
        # symmetric buffers whose leading axis is W -> where a use is no rotation (or None)
        self.rotation_uses = _rotation_uses(data, self.env, file)
        self.rotating = _rotating(self.rotation_uses)

    def error(self, mark: Mark, code: str, message: str, hint: str | None = None) -> None:
        if all((d.mark, d.code) != (mark, code) for d in self.errors):  # once, not per hop
            self.errors.append(Diagnostic(mark, code, message, hint))

    # --- buffer indices ------------------------------------------------------
    def _shape(self, name: str) -> list[Any] | None:
        return _shape(self.data.get("buffers"), name)

    def _in_module_memory(self, name: str) -> bool:
        """Buffer ``name`` is of the module's symmetric memory (symmetric or shared, as
        ``Buffer.is_symmetric``): its later-axis slices and a slot's chunks are views of
        it (``Schedule.module_view_of``)."""
        spec = _spec(self.data.get("buffers"), name)
        return bool(spec.get("symmetric") or spec.get("shared"))

    def _local_persist(self, name: str, axis: int, text: str, mark: Mark) -> bool:
        """``name`` is persist and not symmetric (the module's own local tensor, carried
        from call to call), and ``text`` slices a later axis of it: refused (bad-index),
        no view of it is given to the engine."""
        spec = _spec(self.data.get("buffers"), name)
        if not spec.get("persist") or self._in_module_memory(name):
            return False
        self.error(mark, "bad-index",
                   f"'{clipped(text)}' slices axis {axis} of '{name}', a persist buffer that "
                   "is not symmetric; a later-axis slice or a slot's chunk is taken of the "
                   "engine's own tensors or of the module's symmetric memory only",
                   f"read the whole '{name}' in the external step and slice it there, or "
                   f"declare '{name}' 'symmetric: true'")
        return True

    def _leading(self, name: str, axis: int = 0, last: bool = False) -> int | None:
        """The length of axis ``axis`` of buffer ``name`` (None: not an integer, or no
        buffer of an axis after it; ``last``: the buffer's last axis may be it)."""
        shape = self._shape(name)
        if shape is None or len(shape) < axis + (1 if last else 2):
            return None
        first = shape[axis]
        if isinstance(first, int) and not isinstance(first, bool):
            return first
        return self.env.get(first) if isinstance(first, str) else None

    def index(self, text: str, env: dict[str, int], mark: Mark) -> str:
        """``b[e]`` -> ``b_<value of e>``; ``b[:, e]`` (``b[:, :, e]``) likewise, slice e
        of b's axis 1 (2): ``_later_axis``; ``b[e1][:, e2]`` -> ``b_<e1>_<e2>``, a slot's
        chunk: ``_chunk``; any other text unchanged (a whole buffer is
        recorded, to refuse one used both whole and sliced)."""
        found = _INDEXED.match(text.strip())
        if found is None:
            if _IDENT.match(text):
                self.whole.setdefault(text, mark)
                if self.step_op not in (None, "external"):
                    self.bare.setdefault(text, (mark, self.step_op))
            return text
        name, inner = found.group(1), found.group(2)
        rows = _ROWS.match(text.strip())
        if rows and rows.group(3) in _buffer_names(self.data) and rows.group(3) not in env:
            return self._rows(rows.group(1), rows.group(2), rows.group(3), text, env, mark)
        chunk = _CHUNK.match(inner)
        if chunk and "," not in chunk.group(1) and ("," in chunk.group(2) or (
                self._in_module_memory(name) and chunk.group(2).strip()
                and ":" not in chunk.group(2))):  # b[e1][e2]: along the slot's axis 0
            return self._chunk(name, chunk.group(1), chunk.group(2), text, env, mark)
        if "[" in inner and any("," in p for p in inner.split("][")):
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' has more than one index; a name takes one index, "
                       f"of one axis: '{name}[e]' (the leading axis) or '{name}[:, e]' "
                       f"(axis 1), or a slot's chunk '{name}[e1][:, e2]'",
                       f"index one axis of '{name}' and read the slice in an "
                       "external step, or declare the slice a buffer of its own")
            return text
        split = index_axis(inner)
        if split is None:
            parts = [p.strip() for p in inner.split(",")]
            lead_then = (len(parts) > 2 and parts[0] not in ("", ":")
                         and all(p == ":" for p in parts[1:-1]) and parts[-1] not in ("", ":"))
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' is no slice of one axis: an index is one "
                       "expression, after a ':' for each axis before the one it slices",
                       f"write a slot's chunk as '{name}[{parts[0]}][{':, ' * (len(parts) - 2)}"
                       f"{parts[-1]}]' (the slot, then one axis of it)" if lead_then else
                       f"write '{name}[e]' (the leading axis), '{name}[:, e]' (axis 1) or "
                       f"'{name}[:, :, e]' (axis 2)")
            return text
        axis, inner = split
        if axis and not self._later_axis(name, axis, text, mark):
            return text
        where = "leading axis" if axis == 0 else f"axis {axis}"
        lead = self._leading(name, axis)
        first = self._lead_name(name, axis)
        if lead is None and first is not None and self.unbound_world(first):
            what, unit = self.depends(first)
            self.needs_world(mark, f"'{clipped(text)}' indexes buffer '{name}', whose {where} "
                             f"is {what}; a schedule that depends on {first} is "
                             f"unrolled for {unit} at a time", first)
            return text
        if lead is None and axis == 0 and self._not_rows(name, inner, text, env, mark):
            return text
        if lead is None:
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' indexes buffer '{name}', whose {where} is not an "
                       "integer (or which is not a buffer of "
                       f"{axis + 2 if axis else 'two'} or more axes)",
                       "declare the buffer with an integer leading axis, e.g. "
                       "'shape: [2, N, D]'" if axis == 0 else
                       f"declare the buffer with an integer axis {axis} and an axis after "
                       f"it, e.g. 'shape: [{'B, ' if axis == 1 else 'B, H, '}2, N, D]' for "
                       f"'{name}[{':, ' * axis}e]'" if axis <= 2 else
                       f"declare the buffer with an integer axis {axis} and an axis after it")
            return text
        if lead > MAX_SLICES:  # refused before any slice is made (each is a buffer)
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' indexes buffer '{name}', whose {where} has {lead} "
                       f"slices; an indexed buffer is split into one buffer per slice, at "
                       f"most {MAX_SLICES}",
                       f"index a buffer whose {where} counts the slices the steps use "
                       "(e.g. 'shape: [2, N, D]' for double buffering)")
            return text
        value = self._in_range(inner, env, mark, text, lead, f"slice {{}} of '{name}', whose "
                               f"{where}")
        if value is None or not self._one_axis(self.axes_of, name, (axis, text, mark),
                                               f"'{name}'", "buffer"):
            return text
        self.split[name] = lead
        return f"{name}_{value}"

    def _index_decl(self, index: str, name: str, slotted: bool) -> str:
        """The declaration of ``index`` as an index of the rows of ``name`` (of its slot:
        ``slotted``) that the checker accepts, in the file's own size expressions: 1-d,
        i32, values 0..rows - 1, ``distinct: true`` (rows a step writes must be distinct,
        and the step that reads an index may not be the only one that uses it; a range of
        the rows holds a distinct value per row)."""
        shape = self._shape(name) or []
        rows = shape[1 if slotted else 0] if len(shape) > (1 if slotted else 0) else "N"
        own = self._shape(index)
        length = own[0] if own is not None and len(own) == 1 else rows
        top = f"{rows} - 1" if isinstance(rows, str) else f"{rows - 1}"
        return (f"'{index}: {{shape: [{length}], dtype: i32, values: {{min: 0, max: {top}, "
                "distinct: true}}'")

    def _not_rows(self, name: str, inner: str, text: str, env: dict[str, int],
                  mark: Mark) -> bool:
        """``q[half1][0]``, ``q[halfx]`` (no such buffer), ``q[-half1]``, ``q[half1 + 1]``,
        ``q[hh[0]]`` of a buffer whose leading axis is no integer: meant as rows by values
        (``_rows``), which take the name of a declared index alone. Refused (bad-index)
        with the form to write (True); False: no rows access meant (the slice message)."""
        declared = _buffer_names(self.data)
        sizes = self.data.get("sizes") if isinstance(self.data, dict) else None
        known = set(env) | set(sizes if isinstance(sizes, dict) else ()) | {"r", "W"}
        named = [n for n in re.findall(r"[a-z][a-z0-9_]*", inner) if n not in known]
        if not named:  # sizes, the hop index, r, W: a slice index (the slice message)
            return False
        index = next((n for n in named if n in declared), named[0])
        form = f"{name}[{index}]"
        rows = "rows by values name the rows of axis 0 by a declared 1-d integer buffer, " \
            f"its name alone in one bracket: '{form}'"
        if index not in declared:
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' indexes buffer '{name}' by '{index}', which is no "
                       f"buffer, size or hop index; {rows}",
                       f"declare {self._index_decl(index, name, False)} (the engine's "
                       f"input, or an engine step's output) and write '{form}'")
        else:
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' indexes buffer '{name}' by '{clipped(inner)}', "
                       f"which is no rows by values: {rows} (an index computed from it, a "
                       "second index or an element of it is an engine step's to write into "
                       "a buffer of its own)",
                       f"write '{form}'" if self._is_index(index) else
                       f"declare {self._index_decl(index, name, False)} and write '{form}'")
        return True

    def _is_index(self, index: str) -> bool:
        """Whether ``index`` is declared as rows by values take one (1-d i32/i64 with values)."""
        spec = _spec(self.data.get("buffers"), index)
        shape = spec.get("shape")
        return (isinstance(shape, list) and len(shape) == 1 and spec.get("dtype") in ("i32", "i64")
                and isinstance(spec.get("values"), dict))

    def _rows(self, name: str, slot: str | None, index: str, text: str, env: dict[str, int],
              mark: Mark) -> str:
        """``b[idx]`` (``b[e][idx]``: of slot e): the rows of axis 0 of b (of the slot)
        that the values of the 1-d integer buffer idx name, as torch's ``b[idx]``, in an
        external step's reads or writes only: ``'b'`` (``'b_<e>'``), the access recorded
        in ``step_rows`` (``op`` writes it as the step's ``ROWS``: External.rows). Its
        bounds (``values`` within that axis, distinct where written) are checked for every
        binding by dcpc.check.names."""
        where = f"'{clipped(text)}' takes the rows of '{name}' that the values of '{index}' name"
        if self.step_op != "external" or self.step_key not in ("reads", "writes"):
            self.error(mark, "bad-index",
                       f"{where} in {_place(self.step_op, self.step_key)}; "
                       "rows chosen by a buffer's values are a gather (a scatter when written), "
                       "which only an external step's reads and writes take (the module's "
                       "kernels move rows named by constants and sizes)",
                       f"read '{clipped(text)}' in an external step that writes a buffer of "
                       "its own, and give that buffer to this step")
            return text
        if not self._is_index(index):
            self.error(mark, "bad-index",
                       f"{where}, but '{index}' is not a 1-d integer buffer (i32, i64) with "
                       "'values: {min, max}': its values must be rows that exist",
                       f"declare {self._index_decl(index, name, slot is not None)}")
            return text
        target = name
        if slot is not None:
            target = self.index(f"{name}[{slot}]", env, mark)
            if not re.fullmatch(rf"{re.escape(name)}_\d+", target):
                return text  # the slot's index was refused
        else:
            self.index(name, env, mark)  # the buffer is used whole (no slice of it)
        seen = self.step_rows.get(target)
        if seen is not None and seen[0] != index:
            self.error(mark, "bad-index",
                       f"{where}; '{clipped(seen[2])}' at {seen[3]} takes its rows by "
                       f"'{seen[0]}' in the same step: a step takes a buffer's rows by one "
                       "index", f"write '{name}{'' if slot is None else f'[{slot}]'}[{seen[0]}]' "
                       "here too, or split the step")
            return text
        if seen is None or self.step_key == "writes":
            self.step_rows[target] = (index, self.step_key, text, mark)
        key = (target, self.step_key)
        self.step_rows_count[key] = self.step_rows_count.get(key, 0) + 1
        return target

    def _chunk(self, name: str, first: str, later: str, text: str, env: dict[str, int],
               mark: Mark) -> str:
        """``b[e1][:, e2]``: chunk e2 of axis 1 (``b[e1][:, :, e2]``: axis 2; ``b[e1][e2]``:
        axis 0, torch's ``b[e1][e2]``) of slot e1 of a buffer the module owns, in an
        external step: ``'<b>_<e1>_<e2>'``, a view of the slot ``'<b>_<e1>'`` (which
        stays a contiguous buffer, what shifts and ragged puts move). A 1-d slot's
        chunk is one element, a 0-d view ``select(0, e2)`` of shape [] (``_parts`` marks
        it ``ELEMENT``: the one buffer of no axis)."""
        split = index_axis(later)
        module = self._in_module_memory(name)
        if split is not None and not module and self._local_persist(name, split[0] + 1,
                                                                    text, mark):
            return text
        if split is None or not module:
            shape = self._shape(name)
            rest = f"shape {_plain(shape[1:])}" if shape else "the slot's shape"
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' is no chunk of a slot: after the slot's index "
                       "comes one later-axis index of the slot (a ':' for each axis before "
                       "it), of a symmetric or shared buffer" + (
                           "" if module else f"; '{name}' is the engine's"),
                       f"write '{name}[e1][:, e2]'" if module else
                       f"declare '{name}' symmetric or shared, or one buffer per slot "
                       f"({rest}) and write '<that buffer>"
                       f"[{':, ' * (split[0] if split else 1)}e2]'")
            return text
        axis, expr = split
        if axis == 0 and self.step_op not in (None, "external"):
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' takes a chunk of a slot of '{name}' along the "
                       f"slot's axis 0 in a step of op '{self.step_op}'; a slot's chunk is a "
                       "view of the module's memory that only an external step takes",
                       f"take '{clipped(text)}' in an external step's reads or writes, or "
                       f"name the whole slot '{name}[{first.strip()}]' here")
            return text
        if axis and not self._later_axis(name, axis, text, mark):
            return text
        slot = self.index(f"{name}[{first}]", env, mark)
        if not re.fullmatch(rf"{re.escape(name)}_\d+", slot):
            return text  # the slot's index was refused (or a rotation: not a slot of b)
        # a 1-d slot's chunk (axis 0 the slot's last): one element, a 0-d view
        lead = self._leading(name, axis + 1, last=axis == 0)
        if lead is None or lead > MAX_SLICES:
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' takes a chunk of axis {axis} of slot '{slot}' of "
                       f"'{name}', whose axis {axis + 1} is not an integer of at most "
                       f"{MAX_SLICES} slices (or which has no axis after it)",
                       f"declare '{name}' with an integer axis {axis + 1}, e.g. "
                       "'shape: [2, B, 2, C, D]' for 'b[s][:, i]'")
            return text
        value = self._in_range(expr, env, mark, text, lead, f"chunk {{}} of a slot of "
                               f"'{name}', whose axis {axis + 1}")
        entry = (axis, text, mark, lead, f"{name}[{slot[len(name) + 1:]}]")
        if value is None or not self._one_axis(self.chunks, slot, entry, f"slot '{slot}'",
                                               "slot"):
            return text
        return f"{slot}_{value}"

    def _in_range(self, expr: str, env: dict[str, int], mark: Mark, text: str, lead: int,
                  what: str) -> int | None:
        """The value of index ``expr`` of ``text`` when it is in 0..lead-1, else None
        (bad-index, naming it as ``what`` with the value filled in)."""
        value = self._value(expr, env, mark, text)
        if value is not None and not 0 <= value < lead:
            self.error(mark, "bad-index", f"'{clipped(text)}' is {what.format(value)} has "
                       f"{lead} slices (0..{lead - 1})" + self._at(env))
            return None
        return value

    def _one_axis(self, table: dict[str, Any], key: str, entry: tuple, what: str,
                  noun: str) -> bool:
        """Record the axis ``entry`` = (axis, text, mark, ...) slices ``key`` along, in
        ``table``; False (mixed-index) when an earlier index sliced another."""
        seen = table.setdefault(key, entry)
        if seen[0] == entry[0]:
            return True
        axis, text, mark = entry[:3]
        self.error(mark, "mixed-index",
                   f"'{clipped(text)}' slices axis {axis} of {what}, which "
                   f"'{clipped(seen[1])}' at {seen[2]} slices along axis {seen[0]}; a "
                   f"{noun} is sliced along one axis",
                   "slice it along one axis everywhere, or declare two buffers")
        return False

    def _later_axis(self, name: str, axis: int, text: str, mark: Mark) -> bool:
        """Whether ``b[:, e]`` (a slice of axis ``axis`` > 0) may be taken here: in an
        external step. Such a slice is a strided view: the kernels take contiguous rows,
        so no method (a communication op, a copy, a merge) takes one (bad-index); of a
        buffer in the module's symmetric memory (symmetric, shared) the engine gets a
        view of it (``_split_buffers``: the buffer stays whole); of a persist one that is
        not symmetric, none (``_local_persist``)."""
        if self.step_op not in (None, "external"):
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' slices axis {axis} of '{name}' in a step of op "
                       f"'{self.step_op}'; a slice along a later axis is a strided view, which "
                       "only an external step takes (the module's kernels move contiguous "
                       "rows)", f"read '{name}[:, e]' in an external step that writes a "
                       "buffer of its own, and give that buffer to this step")
            return False
        return not self._local_persist(name, axis, text, mark)

    def _lead_name(self, name: str, axis: int = 0) -> str | None:
        """The size name buffer ``name``'s axis ``axis`` is declared as (None: another)."""
        shape = self._shape(name)
        first = shape[axis] if shape is not None and len(shape) >= axis + 2 else None
        return first if isinstance(first, str) else None

    def needs_world(self, mark: Mark, message: str, name: str = "W") -> None:
        """A trip count, index, offset or interleave names W (or a mesh axis' size,
        ``name``), and no W (no mesh shape) was given (loop-world)."""
        shape = "x".join("2" for _ in self._axis_names())
        if name == "W":
            hint = "check or compile with --world N (or a list: each W is checked on its own)"
        elif self.world is not None and len(shape_of(self.world)) == 1:
            # a flat group size given for a mesh file: it binds W only
            message += (f"; the file declares a mesh ({' x '.join(self._axis_names())}), "
                        f"and the group size {self.world} given is no mesh shape")
            hint = f"give --world as a mesh shape, e.g. --world {shape}"
        else:
            hint = (f"check or compile with --world as mesh shapes, e.g. {shape} (or a "
                    "list: each shape is checked on its own)")
        self.error(mark, "loop-world", message, hint)

    def _axis_names(self) -> list[str]:
        mesh = self.data.get("mesh")
        return [k for k in mesh if k not in (MARK, MARKS)] if isinstance(mesh, dict) else []

    def unbound_world(self, name: str) -> bool:
        """``name`` is W or a mesh axis' size, and the group size given binds none."""
        return (name == "W" or name in self.axes) and name not in self.env

    def depends(self, name: str) -> tuple[str, str]:
        """('W', 'one W') or ('G (the size of mesh axis 'gpu')', 'one mesh shape'): how
        a message names what the unrolling depends on, and what it is unrolled for."""
        if name == "W":
            return "W", "one W"
        return (f"{name} (the size of mesh axis '{self._axis_names()[self.axes[name]]}')",
                "one mesh shape")

    def _at(self, env: dict[str, int]) -> str:
        hops = [f"{k}={v}" for k, v in env.items() if k not in self.env]
        where = ([f"W={self.world}"] if self.world is not None else []) + hops
        return f" (at {', '.join(where)})" if where else ""

    def _value(self, inner: str, env: dict[str, int], mark: Mark, text: str) -> int | None:
        if "[" in inner or "]" in inner:
            self.error(mark, "bad-index",
                       f"'{clipped(text)}' has more than one index; an index names a slice of the "
                       "buffer's leading axis, so a name takes one: 'b[e]'",
                       self._one_index_hint(text))
            return None
        try:
            return _mod_value(inner, env)
        except ex.UnboundSymbol as err:
            if self.unbound_world(err.args[0]):
                what, unit = self.depends(err.args[0])
                self.needs_world(mark, f"index '{clipped(inner)}' of '{clipped(text)}' names "
                                 f"{what}; a schedule that depends on {err.args[0]} is "
                                 f"unrolled for {unit} at a time", err.args[0])
                return None
            named = err.args[0]
            self.error(mark, "bad-index",
                       f"index '{clipped(inner)}' of '{clipped(text)}' names "
                       f"'{named}', which is not the hop index, W or an integer size here"
                       + (f": an index writes the rank as '{OWNER}' ('{RANK}' is its name "
                          "in a when: condition)" if named == RANK else ""),
                       f"write '{clipped(_renamed(text, RANK, OWNER))}'"
                       if named == RANK else None)
        except (ex.ExprSyntaxError, ex.InexactDivision, ValueError) as err:
            self.error(mark, "bad-index", f"index '{clipped(inner)}' of '{clipped(text)}': {err}",
                       "an index is an expression of the hop index, W and integer sizes "
                       "(+ - * /) and '%' by an integer constant, which takes everything on "
                       "its left up to the enclosing '(': 'h % 2', '2 * (h % 2) + 1'")
        return None

    def _one_index_hint(self, text: str) -> str:
        """What to write for ``b[i][j]``: one leading axis of P * Q slices, index
        ``Q * (i) + j`` (exact when the buffer's second axis is an integer Q)."""
        found = _INDEXED.match(text.strip())
        parts = found.group(2).split("][") if found else []
        shape = self._shape(found.group(1)) if found else None
        dims = [d if isinstance(d, int) else self.env.get(d) if isinstance(d, str) else None
                for d in (shape[:2] if shape is not None else [])]
        if len(parts) == 2 and self._in_module_memory(found.group(1)):
            return (f"a slot's chunk is its slot's index, then one index of the slot: "
                    f"'{found.group(1)}[{parts[0].strip()}][e2]' (along the slot's axis 0) "
                    f"or '{found.group(1)}[{parts[0].strip()}][:, e2]' (in an external "
                    "step)")
        if (len(parts) == 2 and shape is not None and len(shape) > 2  # still two axes or more
                and all(isinstance(d, int) for d in dims)):
            p, q = dims
            rest = ", ".join(str(d) for d in shape[2:])
            return (f"declare its two leading axes as one of {p} x {q} = {p * q} slices "
                    f"('shape: [{p * q}{', ' + rest if rest else ''}]') and write "
                    f"'{found.group(1)}[{q} * ({parts[0].strip()}) + {parts[1].strip()}]'")
        return ("declare the leading axes as one (e.g. 'shape: [4, N, D]' for [2, 2, N, D]) "
                "and write 'b[2 * (i) + j]' for 'b[i][j]'")

    def rewrite(self, value: Any, env: dict[str, int], mark: Mark) -> Any:
        if isinstance(value, str):
            return self.index(value, env, mark)
        if isinstance(value, list):
            return [self.rewrite(v, env, mark) for v in value]
        return value

    def op(self, name: str, body: dict[str, Any], env: dict[str, int]) -> dict[str, Any]:
        out = copy.copy(body)
        self.step_op = body.get("op") if isinstance(body.get("op"), str) else None
        self.step_key, self.step_rows, self.step_rows_count = None, {}, {}
        text = _offset_expr(body)
        if text is not None:
            at, team = env, _team_w(body, self.data)  # along one axis: W is the team's size
            if team is not None:
                at = {k: v for k, v in env.items() if k != "W"}
                if isinstance(team, int) or team in env:
                    at["W"] = team if isinstance(team, int) else env[team]
            out["offset"] = self.offset(name, body["op"], text, at,
                                        _mark(body, "offset", self.file))
        if _perm(body) is not None:
            out["perm"] = self.perm(name, body, _mark(body, "perm", self.file), env)
            if body["op"] != shift.DEF.name:  # a signal's or wait's: its messages name it
                out[perms.WRITTEN] = body.get(perms.WRITTEN, body["perm"])
        text = _interleave_expr(body)
        if text is not None:
            out["interleave"] = self.interleave(name, text, env,
                                                _mark(body, "interleave", self.file))
        if isinstance(body.get("when"), str):
            out["when"] = self.when(body["when"], env)
        if _shard(body) is not None:
            out["shard"] = self.shard(name, body["shard"], env, _mark(body, "shard", self.file))
        for key, value in body.items():
            if key in (MARK, MARKS, "op", "doc", "channel", "from", "to", "phase", "offset",
                       "interleave", "when", "perm", "shard"):
                continue
            mark = _mark(body, key, self.file)
            self.step_key = key
            if isinstance(value, dict):  # mask_empty
                out[key] = {k: (v if k in (MARK, MARKS) else
                                self.rewrite(v, env, _mark(value, k, self.file)))
                            for k, v in value.items()}
            else:
                out[key] = self.rewrite(value, env, mark)
        self.step_key = None
        if self.step_rows:
            out.update(self._rows_access(out))
        return out

    def _rows_access(self, out: dict[str, Any]) -> dict[str, Any]:
        """An external step's rows by values (``_rows``) as the model takes them: its
        ``ROWS`` (buffer -> index); the index buffers, and the buffers written by rows
        (the other rows keep their values: read), added to its ``reads``."""
        found, self.step_rows = self.step_rows, {}
        for target, (_, _, text, mark) in found.items():
            for key in ("reads", "writes"):
                names = out.get(key)
                named = names.count(target) if isinstance(names, list) else 0
                if named != self.step_rows_count.get((target, key), 0):
                    self.error(mark, "bad-index",
                               f"'{clipped(text)}' takes rows of '{target}', which the step "
                               f"also names whole (or twice) in its {key}: a step names a "
                               "buffer either whole or by its rows, once in reads and once "
                               "in writes", f"name it once as rows '{clipped(text)}' in "
                               f"{key} too, or read it whole in a step of its own")
                    break
        reads = list(out.get("reads", []))
        for target, (index, key, _, _) in found.items():
            for extra in ([target] if key == "writes" else []) + [index]:
                if extra not in reads:
                    reads.append(extra)
        return {"reads": reads, ROWS: {t: v[0] for t, v in found.items()}}

    def owned(self, name: str, body: dict[str, Any], env: dict[str, int]
              ) -> list[tuple[str, dict[str, Any]]]:
        """Step ``name`` unrolled at this hop: [("", its op)], or, when an index of it
        names the rank (``OWNER``), one copy per group of ranks whose indices agree,
        ``("_r<first rank>", op)``, each guarded by ``when: rank == p or ...`` (and by
        the step's own ``when:``): the rank-by-rank checks, the float64 reference and
        the module then treat it as any guarded step (dcpc.lang.when)."""
        hops = env.keys() - self.env.keys()  # a hop index hides a name of the rank
        body = self._rotated(body, env)
        found = _owner_mark(body, self.file, _owner_names(self.data) - hops)
        if found is None:
            return [("", self.op(name, body, env))]
        mark, index = found
        if "W" not in self.env:
            self.needs_world(mark, f"step '{name}' has an index that "
                             f"{names_the_rank(index)}; a step whose slice depends on the "
                             "rank is unrolled into one guarded copy per rank, for one W at "
                             "a time")
            return []
        groups: dict[str, tuple[list[int], dict[str, Any]]] = {}
        for rank, at in self._ranks(env):
            out = self.op(name, body, at)
            key = repr({k: v for k, v in out.items() if k not in (MARK, MARKS)})
            groups.setdefault(key, ([], out))[0].append(rank)
        if len(groups) == 1:  # the same slices on every rank at this W: no guard
            return [("", next(iter(groups.values()))[1])]
        copies = []
        for ranks, out in groups.values():
            cond = " or ".join(f"{RANK} == {p}" for p in ranks)
            own = out.get("when")
            marks = out.get(MARKS, {})  # a when: of the step's own keeps its place
            out = {**out, "when": cond if own is None else f"({own}) and ({cond})",
                   MARKS: {**marks, "when": marks.get("when", mark) if own else mark,
                           OWNER_MARK: mark}, OWNER_COPY: OwnerCopy(
                       name, ranks[0], index, self._no_rotation(body, env))}
            copies.append((f"_r{ranks[0]}", out))
        return copies

    def _no_rotation(self, body: dict[str, Any], env: dict[str, int]) -> str:
        """Why the first index of ``r`` of step ``body`` on a symmetric buffer whose
        leading axis is W is no rotation (its c at two ranks, or the buffer's other use
        that forced the copies), for ``bad-index`` on a communication step; "" if none."""
        owners = _owner_names(self.data) - (env.keys() - self.env.keys())
        texts = [v for k, v in body.items() if k not in _NOT_SLICES]
        for text in (t for v in texts for t in (v if isinstance(v, list) else [v])):
            found = _INDEXED.match(text.strip()) if isinstance(text, str) else None
            if (found is None or found.group(1) not in self.rotation_uses
                    or not _names_w(found.group(2), {OWNER} & owners)):
                continue
            name, inner, world = found.group(1), found.group(2), int(self.env["W"])
            if _rotation_offset(inner, owners) is not None:
                where = self.rotation_uses[name]
                return ("" if where is None else f"'{name}' is also used at {where} "
                        "otherwise than by a rotation, so its rank indices are copies per rank")
            seen: dict[int, int] = {}
            for rank, at in self._ranks(env):
                try:
                    turn = (_mod_value(inner, at) - rank) % world
                except (ex.UnboundSymbol, ex.ExprSyntaxError, ex.InexactDivision,
                        ValueError, ArithmeticError):
                    return ""
                seen.setdefault(turn, rank)
                if len(seen) == 2:
                    (c0, r0), (c1, r1) = seen.items()
                    return (f"'{clipped(text.strip())}' is no rotation r + c mod W (at "
                            f"W={world}: r={r0} gives c={c0}, r={r1} gives c={c1})")
            return (f"'{clipped(text.strip())}' is r + {next(iter(seen), 0)} mod W on "
                    f"every rank at W={world} but not written as a rotation: write "
                    "'r', '(r + E) % W' or '(r - E) % W'")
        return ""

    def _ranks(self, env: dict[str, int]) -> Iterable[tuple[int, dict[str, int]]]:
        """(rank, ``env`` with the rank's names bound) for every rank of this W: ``r``
        and, on a mesh, each axis' coordinate (a hop index of the same name hides it)."""
        hops = env.keys() - self.env.keys()
        axes, shape = sorted(_coordinates(self.data), key=self._axis_names().index), ()
        if axes and self.world is not None and len(shape_of(self.world)) == len(axes):
            shape = shape_of(self.world)  # the coordinates are the mesh shape's
        for rank in range(int(self.env["W"])):
            coords = zip(axes, torus(shape).coords(rank), strict=True) if shape else ()
            at = {**env, **{k: v for k, v in coords if k not in hops}}
            if OWNER not in hops:
                at[OWNER] = rank
            yield rank, at

    def _rotated(self, body: dict[str, Any], env: dict[str, int]) -> dict[str, Any]:
        """Step ``body`` with each index that is a ROTATION of the rank written as the
        buffer it names: ``b[e]`` of a symmetric buffer whose leading axis is W, where
        ``e`` is ``r + c`` mod W on every rank r for one c, is ``b_rot<c>``, a buffer of
        its own (slice (r + c) mod W of b on rank r, in every rank's view alike, so the
        per-rank renaming of b's slices is one-to-one on each rank and every stage may
        treat ``b_rot<c>`` as any buffer: one step that every rank runs, no copies). A
        buffer also indexed otherwise (``fixed``) keeps the copies per rank."""
        if "W" not in self.env:
            return body
        out = dict(body)
        for key, value in body.items():
            if key in _NOT_SLICES:
                continue
            if isinstance(value, dict):  # mask_empty
                out[key] = {k: (v if k in (MARK, MARKS) else self._rotation(
                    v, env, _mark(value, k, self.file), body)) for k, v in value.items()}
            else:
                out[key] = self._rotation(value, env, _mark(body, key, self.file), body)
        return out

    def _rotation(self, value: Any, env: dict[str, int], mark: Mark,
                  body: dict[str, Any]) -> Any:
        """``value`` (a name, an indexed name or a list) with a rotation index renamed:
        one recognised by its form (``_rotation_offset``), its c computed once, never
        rank by rank."""
        if isinstance(value, list):
            return [self._rotation(v, env, mark, body) for v in value]
        found = _INDEXED.match(value.strip()) if isinstance(value, str) else None
        hops = env.keys() - self.env.keys()
        if (found is None or OWNER in hops
                or not _names_w(found.group(2), _owner_names(self.data) - hops)):
            return value
        name, world = found.group(1), int(self.env["W"])
        offset = _rotation_offset(found.group(2), _owner_names(self.data) - hops)
        if offset is None or name not in self.rotating:
            return value
        if _team_w(body, self.data) is not None:  # refused in both passes of ``run``
            self.error(mark, "bad-index",
                       f"'{value.strip()}' rotates the rank on a step along mesh axis "
                       f"'{body.get('axis')}', but r is the rank in the whole mesh, not in "
                       "the axis' team: the rotation would not name the team's sender",
                       "index by the axis' coordinate in the local steps, or take the "
                       "rotation on a step of the whole world")
            return value
        if name in self.fixed:
            return value
        try:
            turn = _mod_value(offset, env) % world
        except (ex.UnboundSymbol, ex.ExprSyntaxError, ex.InexactDivision, ValueError,
                ArithmeticError):
            return value  # the copies' unrolling reports it
        alias = ROTATION.format(name, turn)
        self.rotated.setdefault(alias, (name, turn, mark))
        return alias

    def shard(self, name: str, value: Any, env: dict[str, int], mark: Mark) -> Any:
        """External step ``name``'s ``shard`` on this rank: its value, a rank of this W
        (``value`` unchanged, with ``bad-index``, when it is none)."""
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            self.error(mark, "bad-index", f"step '{name}': shard {value!r} is not a rank "
                       "or an expression of r, the hop index and W")
            return value
        if self.world is None:
            self.needs_world(mark, f"step '{name}' names a shard, a rank; a schedule with "
                             "one is checked for one W at a time")
            return value
        found = value if isinstance(value, int) else self._value(
            value, env, mark, f"shard: {value}")
        if found is None:
            return value
        if not 0 <= found < int(self.env["W"]):
            self.error(mark, "bad-index", f"step '{name}': shard '{value}' is {found}"
                       f"{self._at(env)}, not a rank 0..{int(self.env['W']) - 1}")
            return value
        return found

    def when(self, text: str, env: dict[str, int]) -> str:
        """A step's ``when:`` with the hop indices of the loops around it replaced by
        their values (constant parts folded): the condition then names the rank, W and
        sizes only; unchanged when it does not parse (the checker says why, located)."""
        try:
            tree = ex.parse_condition(text)
        except ex.ExprSyntaxError:
            return text
        hops = {k: v for k, v in env.items() if k not in self.env}
        return ex.unparse(_substitute(tree, hops)) if hops else text

    def offset(self, name: str, kind: str, text: str, env: dict[str, int], mark: Mark) -> Any:
        """The integer value of step ``name``'s offset expression (a shift's, a signal's
        or a wait's: ``kind``) at this W and hop (``text`` unchanged, with an error, when
        it has none)."""
        hint = ("an offset is a nonzero integer, next, prev, or an expression of W, the "
                "hop index and integer sizes (+ - * /), e.g. 'W / 2', 'h + 1'")
        if kind in (sync.SIGNAL.name, sync.WAIT.name):  # a peers word written as an offset
            key = "to" if kind == sync.SIGNAL.name else "from"
            hint = {"self": sync.own_flag_hint(kind),  # the rank itself: its own flag
                    "all": f"drop 'offset' (all peers: '{key}: all')"}.get(text.strip(), hint)
        does, to_itself = _BY_OFFSET[kind]
        what = f"step '{name}' {does} by offset '{clipped(text)}'"
        found = self._expression(what, text, env, mark, "bad-offset", hint,
                                 "not the hop index of an enclosing loop, W or an integer size",
                                 shift.NAMED)
        if found is None:
            return text
        tree, value = found
        # a fixed integer that W divides is a local copy; an expression of W that lands
        # on the rank itself at some W is a mistake (W, or 2 * W / 2), refused here
        # (a ragged_all_to_all to one peer: offset 0 is its own slots, allowed)
        if to_itself is not None and (value == 0 or (
                ("W" in ex.symbols(tree) or self.axes.keys() & ex.symbols(tree))
                and value % env["W"] == 0)):
            self.error(mark, "bad-offset",
                       f"{what} = {value}{self._at(env)}, which {to_itself}"
                       + (f" (a multiple of W={env['W']})" if value else ""),
                       ("use 'copy' to move data on this rank, or " if kind == shift.DEF.name
                        else "use ") + "an offset that is not 0 mod W at any W checked")
            return text
        return value

    def perm(self, name: str, body: dict[str, Any], mark: Mark, env: dict[str, int]) -> Any:
        """Shift step ``name``'s ``perm`` as the destination table at this W
        (dcpc.ops._perm.table_at); ``value`` unchanged, with an error, when it is none:
        ``loop-world`` without a W or at a W its pairs or table do not name, else
        ``bad-perm``. Along one axis of a mesh (``axis: gpu``) the perm names member
        indices of a team of that axis' size, mapped to ranks (dcpc.topology
        ``Torus.perm_ranks``); over several axes (or none named on a mesh), of the team
        of those axes (row-major member order: over every axis, the rank itself)."""
        value, what = body["perm"], f"step '{name}':"
        axes = self._axis_names()
        if len(axes) > 1 and (self.world is None or len(shape_of(self.world)) != len(axes)):
            size = next(iter(self.axes), "W")  # a mesh axis' size: the mesh-shape hint
            self.needs_world(mark, f"{what} its perm's ranks depend on the mesh shape; a "
                             "schedule with a perm is unrolled for one shape at a time", size)
            return value
        hint = ("a perm is an expression of r and W ('W - 1 - r', '(r + W / 2) % W'), a "
                "list of [source, destination] pairs or of destinations (-1: none), "
                "one-to-one")
        if self.world is None:
            fixed = perms.fixed_world(value)
            if fixed is not None:  # pairs or a table: what is wrong with them, at their W
                try:
                    perms.table_at(value, fixed)
                except perms.PermError as err:
                    self.error(mark, "bad-perm", f"{what} its perm is no permutation of the "
                               f"ranks: {err}", hint)
                    return value
            self.needs_world(mark, f"{what} its perm's ranks depend on W; a schedule "
                             "with a perm is unrolled for one W at a time"
                             + (f" (its ranks are those of W={fixed})" if fixed else ""))
            return value
        shape = shape_of(self.world)
        named = body.get("axis")
        named = named if isinstance(named, list) else [named] if named is not None else []
        known = axes or ["world"]  # with no 'mesh:', the one axis is 'world'
        unknown = [n for n in named if n not in known]
        if unknown:  # a typo: said as the structural check says it
            where = (f"the mesh's axes are {', '.join(axes)}" if axes else
                     "the schedule declares no 'mesh:' (its one axis is 'world')")
            self.error(_mark(body, "axis", self.file), "unknown-axis",
                       f"step '{name}' runs over axis '{unknown[0]}', but {where}",
                       did_you_mean(str(unknown[0]), known)
                       or "name an axis of 'mesh:', or declare it there")
            return value
        # the team's axes (every axis when none is named): r is the member index in it
        team = (tuple(sorted({axes.index(n) for n in named if n in axes}))
                or tuple(range(len(shape))))
        size = math.prod(shape[a] for a in team) if len(shape) > 1 else self.env["W"]
        try:
            members = perms.table_at(value, size, {**env, "W": size})
            return members if len(shape) == 1 else list(torus(shape).perm_ranks(members, team))
        except perms.PermError as err:
            text = str(err)
            if text.startswith("W:"):
                fixed = perms.fixed_world(value)
                given = f"{fixed}" if len(team) == len(shape) else (
                    "x".join(str(fixed) if a in team else "2" for a in range(len(shape)))
                    + f" (axis '{axes[team[0]]}' of {fixed} ranks)" if len(team) == 1
                    else f"a mesh shape whose axes {', '.join(axes[a] for a in team)} make "
                    f"{fixed} ranks")
                self.error(mark, "loop-world", f"{what} {text[2:]}",
                           f"check or compile with --world {given} (a perm written as "
                           "a list serves that W only; an expression of r and W serves "
                           "every W)")
            else:
                self.error(mark, "bad-perm", f"{what} its perm is no permutation of the ranks: "
                           f"{text}", hint)
        return value

    def _expression(self, what: str, text: str, env: dict[str, int], mark: Mark, code: str,
                    hint: str, unknown: str, names: Iterable[str] = ()) -> tuple[Any, int] | None:
        """``text`` (a step's offset or interleave, ``what``) parsed and evaluated at this
        W (shape) and hop: (its tree, its value); None after the error: ``loop-world``
        when it names W or an axis' size that no --world binds, else ``code`` (``unknown``
        says what a name must be; ``names``: the words a misspelt one may mean)."""
        try:
            tree = ex.parse(text)
            return tree, ex.evaluate(tree, env)
        except ex.UnboundSymbol as err:
            if self.unbound_world(err.args[0]):
                named, unit = self.depends(err.args[0])
                self.needs_world(mark, f"{what}, which names {named}; a schedule that "
                                 f"depends on {err.args[0]} is unrolled for {unit} at a time",
                                 err.args[0])
            else:
                self.error(mark, code, f"{what}, which names '{err.args[0]}': {unknown}",
                           did_you_mean(err.args[0], names) or hint)
        except (ex.ExprSyntaxError, ex.InexactDivision) as err:
            self.error(mark, code, f"{what}{self._at(env)}: {err}", hint)
        return None

    def interleave(self, name: str, text: str, env: dict[str, int], mark: Mark) -> Any:
        """The integer value of all_gather step ``name``'s interleave expression at this
        W (shape) and hop (``text`` unchanged, with an error, when it has none)."""
        hint = ("an interleave is a positive integer or an expression of W, the mesh's "
                "axis sizes, the hop indices and integer sizes (+ - * /), e.g. 'C', 'H / HK'")
        what = f"step '{name}' interleaves by '{clipped(text)}'"
        found = self._expression(what, text, env, mark, "bad-interleave", hint,
                                 "not W, a mesh axis' size, a hop index or an integer size")
        if found is None:
            return text
        value = found[1]
        if value < 1:
            self.error(mark, "bad-interleave", f"{what} = {value}{self._at(env)}; an "
                       "interleave is a positive number of rows", hint)
            return text
        return value

    # --- loops ---------------------------------------------------------------
    def trips(self, name: str, body: dict[str, Any], env: dict[str, int]) -> int | None:
        mark = _mark(body, "repeat", self.file)
        value = body.get("repeat")
        try:
            tree = ex.parse(value)
            unbound = sorted((n != "W", n) for n in ex.symbols(tree) if self.unbound_world(n))
            if unbound:
                what, unit = self.depends(unbound[0][1])
                self.needs_world(mark, f"loop '{name}' repeats '{clipped(str(value))}' "
                                 f"times, which depends on {what}; it is unrolled for "
                                 f"{unit} at a time", unbound[0][1])
                return None
            trips = ex.evaluate(tree, env)
        except ex.UnboundSymbol as err:
            also = (", a mesh axis' size" if self.axes else "") + (
                ", an enclosing loop's hop index" if len(env) > len(self.env) else "")
            self.error(mark, "bad-repeat",
                       f"loop '{name}' repeats '{clipped(str(value))}' times, but "
                       f"'{err.args[0]}' is not W{also} or an integer size",
                       "a trip count is an expression of W and sizes declared as plain "
                       "integers")
            return None
        except (ex.ExprSyntaxError, ex.InexactDivision) as err:
            shown = (f"'repeat: {clipped(str(value))}'" if isinstance(value, (str, int))
                     else "'repeat'")
            self.error(mark, "bad-repeat", f"loop '{name}': {shown}: {err}",
                       "a trip count is an integer or an expression of W and sizes "
                       "declared as plain integers, e.g. 'W - 1'")
            return None
        if trips < 0:
            self.error(mark, "bad-repeat",
                       f"loop '{name}' repeats '{clipped(str(value))}' = {trips} times"
                       + self._at(env if len(env) > len(self.env) else {}))
            return None
        return trips

    def loop(self, name: str, body: dict[str, Any], env: dict[str, int] | None = None,
             outer: tuple[tuple[str, str], ...] = (), tag: str = "") -> list[dict[str, Any]]:
        """The unrolled steps of loop ``name``; ``outer``: (loop, hop index) of the loops
        around it, outermost first, ``tag`` the name suffix of their hops (``_h1``)."""
        env = dict(self.env) if env is None else env
        for key in body:
            if key not in (MARK, MARKS, *LOOP_KEYS):
                self.error(_mark(body, "key:" + key, self.file), "unknown-key",
                           f"unknown key '{key}' in loop '{name}'",
                           f"a loop has keys {', '.join(LOOP_KEYS)}")
        hop = body.get("as")
        if not isinstance(hop, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", hop):
            self.error(_mark(body, "as", self.file), "bad-loop",
                       f"loop '{name}' needs 'as: <hop index name>' (a lowercase name)")
            return []
        around = dict((index, loop) for loop, index in outer)
        if hop in around:
            self.error(_mark(body, "as", self.file), "bad-loop",
                       f"loop '{name}' names its hop index '{hop}', as loop '{around[hop]}' "
                       "around it does; the loops of a nest need one index each",
                       f"name the inner index otherwise, e.g. 'as: {hop}2'")
            return []
        inner = body.get("steps")
        if not isinstance(inner, list) or not inner:
            self.error(_mark(body, "steps", self.file), "bad-loop",
                       f"loop '{name}' needs 'steps:', a non-empty list of steps")
            return []
        body = self._loop_when(name, body, {hop, *(i for _, i in outer)})
        trips = self.trips(name, body, env)
        if trips is None:
            return []
        if not outer and not self._fits(name, body, trips, inner):
            return []
        out = []
        for h in range(trips):
            hop_env = {**env, hop: h}
            hop_tag = f"{tag}_{h}" if outer else f"_h{h}"
            for item in inner:
                named = _body(item)
                if named is None or not isinstance(named[1], dict):
                    self.error(_mark(item, None, self.file) if isinstance(item, dict)
                               else _mark(body, "steps", self.file), "bad-step",
                               f"a step of loop '{name}' is a mapping with one name")
                    return []
                step, op = named
                op = _guarded(op, body, self.file)
                if _is_loop(op):
                    if len(outer) + 1 >= MAX_NEST:
                        self.error(_mark(op, "repeat", self.file), "bad-loop",
                                   f"loop '{step}' is inside loop '{name}', "
                                   f"{len(outer) + 2} loops deep; loops nest at most "
                                   f"{MAX_NEST} deep", "unroll the innermost loop by hand")
                        return []
                    out += self.loop(step, op, hop_env, (*outer, (name, hop)), hop_tag)
                    if self.count > MAX_HOPS:
                        return out
                    continue
                marks = dict(item.get(MARKS, {}))
                for tag_r, body_r in self.owned(step, op, hop_env):
                    out.append({f"{step}{hop_tag}{tag_r}": body_r, MARKS: {
                        "key:" + f"{step}{hop_tag}{tag_r}": marks.get("key:" + step),
                        f"{step}{hop_tag}{tag_r}": marks.get(step)}})
                    self.count += 1
                if self.count > MAX_HOPS:  # the backstop: the trip counts' bound took a
                    # step for one that unrolled to more (copies per rank after all)
                    self.error(_mark(body, "repeat", self.file), "loop-too-long",
                               f"with loop '{name}' unrolled the schedule has more than "
                               f"{MAX_HOPS} steps{self._at({})} (the unroller stopped "
                               f"there); the checker analyses at most {MAX_STEPS} steps",
                               "check a smaller --world, or fewer steps per hop")
                    return out
        return out

    def _loop_when(self, name: str, body: dict[str, Any], hops: set[str]) -> dict[str, Any]:
        """Loop ``name`` with its ``when:`` checked once, at its own mark and with its own
        text (bad-when: not a string, no condition, a name no rank knows; ``hops``: its
        hop index and those of the loops around it); a bad one is dropped (the file is
        refused already), so the steps inside repeat no error of it."""
        cond = body.get("when")
        if cond is None:
            return body
        mark = _mark(body, "when", self.file)
        hint = ("a condition (a string) compares expressions of rank, W, integer sizes, "
                "mesh axes and the hop indices with < <= > >= == !=, joined by and, or, "
                "not: e.g. when: \"h < W - 1\"")
        if not isinstance(cond, str):
            self.error(mark, "bad-when", f"loop '{name}': when: is "
                       f"{clipped(repr(cond))}, not a condition", hint)
            return {k: v for k, v in body.items() if k != "when"}
        try:
            tree = ex.parse_condition(cond)
        except ex.ExprSyntaxError as err:
            self.error(mark, "bad-when", f"loop '{name}': when '{clipped(cond)}': {err} "
                       f"(at character {err.column + 1} of the condition)", hint)
            return {k: v for k, v in body.items() if k != "when"}
        mesh = self.data.get("mesh")
        axes = {k for k in mesh if k not in (MARK, MARKS)} if isinstance(mesh, dict) else set()
        known = {RANK, "W", *_int_sizes(self.data), *_axis_sizes(self.data), *axes, *hops}
        bad = min(ex.symbols(tree) - known, default=None)
        if bad is None:
            return body
        self.error(mark, "bad-when", f"loop '{name}': when '{clipped(cond)}' names '{bad}', "
                   "which is not rank, W, an integer size, a mesh axis or the hop index of "
                   "this loop or of a loop around it", did_you_mean(bad, known) or hint)
        return {k: v for k, v in body.items() if k != "when"}

    def _fits(self, name: str, body: dict[str, Any], trips: int, inner: list[Any]) -> bool:
        """Whether the nest of loop ``name`` (a loop of the schedule's own steps) unrolls
        within the step and hop bounds: found from its trip counts, before any step of it
        is unrolled (loop-too-long)."""
        flat = not any(_is_loop(b[1]) for b in map(_body, inner) if b)
        if flat:  # a loop of plain steps: its hops times its steps (a step per rank of
            # one whose index names the rank)
            steps, hops = trips * sum(_copies(i, self.env, _owner_names(self.data),
                                              self.rotating) for i in inner), trips
        else:
            count = [0, 0]
            _tally([{name: body}], self.env, 0, count, _owner_names(self.data),
                   self.rotating)
            steps, hops = count
        if steps > MAX_STEPS:
            per = steps // trips if flat and trips else len(inner)
            shape = (f"{trips} hops x {per} steps = {steps} steps" if flat else
                     f"{steps} steps over the loops inside it") + (
                " (a step whose index names the rank counts once per rank)"
                if per != len(inner) else "")
            self.error(_mark(body, "repeat", self.file), "loop-too-long",
                       f"loop '{name}' unrolls to {shape}{self._at({})}; the checker unrolls "
                       f"every hop and analyses at most {MAX_STEPS} steps",
                       "check a smaller --world, or fewer steps per hop")
            return False
        if hops > MAX_HOPS:
            self.error(_mark(body, "repeat", self.file), "loop-too-long",
                       f"loop '{name}' and the loops inside it count {hops} hops"
                       f"{self._at({})} (an inner loop's hops once per hop around it), above "
                       f"the {MAX_HOPS} the unroller walks", "shorten the loops' trip counts")
            return False
        return True

    def run(self) -> dict[str, Any]:
        data = self._unroll()
        # a buffer indexed by rotations and also by a fixed slice or whole: its slices
        # are not renamed per rank (one name, one memory); unrolled again with its
        # rank-indexed steps copied per rank, as before rotations were taken
        mixed = {base for base, _, _ in self.rotated.values()} & (
            set(self.split) | set(self.whole))
        if mixed:
            self.fixed |= mixed
            self.errors, self.split, self.whole, self.rotated = [], {}, {}, {}
            self.axes_of, self.bare, self.chunks = {}, {}, {}
            self.count = 0
            data = self._unroll()
        self._split_buffers(data)
        if self.errors:
            raise DiagnosticError(self.errors)
        return data

    def _unroll(self) -> dict[str, Any]:
        data = dict(self.data)
        flat: list[Any] = []
        for item in data.get("steps") or []:
            named = _body(item)
            if self.count > MAX_HOPS:
                break
            if named and _is_loop(named[1]):
                self.count = len(flat)
                flat += self.loop(*named)
            elif named and isinstance(named[1], dict):
                marks = dict(item.get(MARKS, {}))
                for tag_r, body_r in self.owned(*named, dict(self.env)):
                    step = named[0] + tag_r
                    if not tag_r:
                        flat.append({**item, step: body_r})
                        continue
                    flat.append({step: body_r, MARKS: {
                        **marks, "key:" + step: marks.get("key:" + named[0]),
                        step: marks.get(named[0])}})
            else:
                flat.append(item)
        data["steps"] = flat
        looped = [(name, body) for name, body in loops(self.data) if isinstance(body, dict)]
        if len(flat) > MAX_STEPS and looped and not self.errors:
            name, body = looped[-1]
            self.error(_mark(body, "repeat", self.file), "loop-too-long",
                       f"with loop '{name}' unrolled the schedule has {len(flat)} steps"
                       f"{self._at({})}; the checker unrolls every hop and analyses at most "
                       f"{MAX_STEPS} steps", "check a smaller --world, or fewer steps per hop")
        return data

    def _split_buffers(self, data: dict[str, Any]) -> None:
        buffers = data.get("buffers")
        if not isinstance(buffers, dict) or not (self.split or self.rotated or self.chunks):
            return
        out = {k: v for k, v in buffers.items() if k not in (MARK, MARKS)}
        marks = dict(buffers.get(MARKS, {}))
        for alias, (name, _, mark) in sorted(self.rotated.items()):
            if alias in out or alias in buffers:
                self.error(mark, "mixed-index",
                           f"buffer '{alias}' is declared, but it is also the name of the "
                           f"rank's rotated slice of '{name}' this index takes",
                           "rename one of them")
                continue
            spec = dict(buffers[name])
            spec["shape"] = spec["shape"][1:]
            out[alias] = spec
            marks["key:" + alias] = marks.get("key:" + name)
            marks[alias] = marks.get(name)
        for name in {base for base, _, _ in self.rotated.values()}:
            out.pop(name, None)  # only its rotations are used (a mixed one was unrolled again)
        aliased: dict[str, int] = {}
        axes: dict[str, int] = {}  # the aliased ones sliced along a later axis
        split: dict[str, int] = {}  # every one split into its slices
        for name, lead in self.split.items():
            spec = out.get(name)
            axis = self.axes_of[name][0]
            if (axis and self._in_module_memory(name)) or (
                    name in self.whole and isinstance(spec, dict) and not (
                    spec.get("symmetric") or spec.get("shared"))):
                # the engine's own tensor used whole and by slice, or a later axis of the
                # module's memory: it stays, and its slices are views of it
                # (Schedule.slices); every stage sees the views' accesses as accesses of
                # the parts of the whole (one set of cells)
                aliased[name] = lead
            elif name in self.whole:
                self.error(self.whole[name], "mixed-index",
                           f"buffer '{name}' is used whole here and by slice elsewhere "
                           "('" + name + "[i]'); a sliced buffer is split into its slices",
                           f"name a slice, e.g. '{name}[0]'")
                continue
            if axis and name in aliased:
                axes[name] = axis
            split[name] = lead
            self._parts(out, marks, buffers, name, lead, axis,
                        dict(out[name] if name in aliased else out.pop(name)))
        slots = {}
        for slot, (axis, _, _, lead, written) in self.chunks.items():
            if isinstance(out.get(slot), dict):  # a slot's chunks: views of the slot
                aliased[slot], axes[slot], slots[slot] = lead, axis, written
                self._parts(out, marks, buffers, slot, lead, axis, dict(out[slot]), written)
        data["buffers"] = {**out, MARKS: marks, MARK: buffers.get(MARK)}
        if aliased:
            data[SLICES] = aliased
            data[SLICE_AXES] = axes
        if slots:
            data[SLOT_TEXT] = slots
        if split:
            data[SPLIT] = split

    def _parts(self, out: dict[str, Any], marks: dict[str, Any], buffers: dict[str, Any],
               name: str, lead: int, axis: int, spec: dict[str, Any],
               written: str | None = None) -> None:
        """Declare the ``lead`` slices ``<name>_<i>`` of buffer ``name`` along ``axis``
        in ``out`` (``spec``: its declaration), each with its shape less that axis.
        ``written``: ``name`` as the file writes it (a slot: ``'b[<s>]'``)."""
        written = written or name
        spec["shape"] = spec["shape"][:axis] + spec["shape"][axis + 1:]
        if not spec["shape"]:  # a 1-d slot's chunk: a 0-d view of the module's memory
            spec[ELEMENT] = True
        for i in range(lead):
            part = f"{name}_{i}"
            if part in out:
                self.error(marks.get("key:" + part) or _mark(buffers, None, self.file),
                           "mixed-index",
                           f"buffer '{part}' is declared, but it is also the name of "
                           f"slice {i} of '{name}'", "rename one of them")
            elif (axis or written != name) and part in self.bare:
                at, op = self.bare[part]
                self.error(at, "bad-index",
                           f"'{part}' is slice {i} of '{written}' along axis {axis} "
                           f"('{written}[{':, ' * axis}{i}]'), named in a step of op "
                           f"'{op}'; " + ("a slice along a later axis is a strided view, "
                                          "which only an external step takes (the module's "
                                          "kernels move contiguous rows)" if axis else
                                          "a slot's chunk is a view of the module's memory, "
                                          "which only an external step takes (the module's "
                                          "kernels move the slot whole)"),
                           f"read '{written}[{':, ' * axis}{i}]' in an external step, or "
                           "declare the chunk a buffer of its own")
            out[part] = self._part_values(spec, buffers, lead, axis, i)
            marks["key:" + part] = marks.get("key:" + name)
            marks[part] = marks.get(name)

    def _part_values(self, spec: dict[str, Any], buffers: dict[str, Any], lead: int,
                     axis: int, i: int) -> dict[str, Any]:
        """Slice ``i``'s declaration: ``spec``, an end of its ``values`` that names a
        buffer split as it is (the same axis, as many slices: ``n_send_gpu[c]`` bounded
        by ``n_send[c]``) renamed to that buffer's slice ``i``. A named buffer split
        otherwise keeps its name, which then names no buffer (``bad-values``)."""
        values = spec.get("values")
        if not isinstance(values, dict):
            return spec
        renamed = dict(values)
        for end in ("min", "max"):
            other = bound_buffer(values.get(end), buffers)
            if (other is not None and self.split.get(other) == lead
                    and self.axes_of.get(other, (None,))[0] == axis):
                renamed[end] = f"{other}_{i}"
        return spec if renamed == values else {**spec, "values": renamed}


def _owner_mark(body: dict[str, Any], file: str,
                names: frozenset[str] | set[str] = frozenset({OWNER}),
                skip: frozenset[str] = frozenset()) -> tuple[Mark, str] | None:
    """Where the first index of step ``body`` that names the rank (one of ``names``:
    ``r``, a mesh coordinate) is, and the name it writes the rank by (the first, by
    name, of several), or None (a step's keys and a mask_empty's, as ``_Unroller.op``
    rewrites them); a rotation's index (``_rotation_offset``) of a buffer in ``skip``
    does not count."""
    shard = _shard(body)
    if isinstance(shard, str) and _names_w(shard, names):
        return _mark(body, "shard", file), _owner_name(shard, names)
    for key, value in body.items():
        if key in (MARK, MARKS, "op", "doc", "when", "perm", "offset", "interleave", "shard"):
            continue
        inner = ({k: (v, _mark(value, k, file)) for k, v in value.items()
                  if k not in (MARK, MARKS)} if isinstance(value, dict)
                 else {key: (value, _mark(body, key, file))})
        for text, mark in inner.values():
            for one in text if isinstance(text, list) else [text]:
                found = _INDEXED.match(one.strip()) if isinstance(one, str) else None
                if (found and _names_w(_index_expr(found.group(2)), names) and not (
                        found.group(1) in skip
                        and _rotation_offset(found.group(2), names) is not None)):
                    return mark, _owner_name(_index_expr(found.group(2)), names)
    return None


def _rotation_offset(inner: str, owners: frozenset[str] | set[str]) -> str | None:
    """The offset c of index ``inner`` when its FORM is a rotation of the rank (r + c mod
    W on every rank): ``r``, ``(r + E) % W``, ``(r - E) % W`` or ``(E + r) % W`` with E
    naming neither the rank nor a mesh coordinate (``owners``); the text of c (the
    index's r read as 0, without its ``% W``), or None. O(1) in W: no rank evaluated."""
    text = inner.strip()
    if text == OWNER:
        return "0"
    body, modulus = _split_mod(text)
    body = body.strip()
    if modulus is None or modulus.strip() != "W" or not body.startswith("("):
        return None
    depth = 0
    for i, ch in enumerate(body):  # the '(' must close at the end: '(r + h) % W'
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and i != len(body) - 1:
            return None
    inside = body[1:-1]
    if _split_mod(inside)[1] is not None:
        return None  # '(r + h % 2) % W' is ((r + h) % 2) % W
    lead = re.fullmatch(rf"\s*{OWNER}\s*([+-])(.*)", inside, re.S)
    tail = re.fullmatch(rf"(.*?)\+\s*{OWNER}\s*", inside, re.S)
    if lead:
        offset = f"0 {lead.group(1)}{lead.group(2)}"
    elif tail and tail.group(1).strip():
        offset = f"{tail.group(1)}+ 0"
    else:
        return None
    return None if _names_w(offset, owners) else offset


def _renamed(text: str, old: str, new: str) -> str:
    """``text`` with the name ``old`` written ``new`` (whole names only)."""
    return re.sub(rf"(?<![A-Za-z0-9_]){old}(?![A-Za-z0-9_])", new, text)


def _owner_name(text: str, names: frozenset[str] | set[str]) -> str:
    """The name of the rank an expression that names one (``_names_w``) writes."""
    return min(names & ex.symbols(ex.parse(text.replace("%", "*"))))


def names_the_rank(name: str) -> str:
    """How a message says that an index names the rank by ``name``: ``r`` or a mesh
    coordinate."""
    return (f"names the rank '{name}'" if name == OWNER else
            f"names the rank's mesh coordinate '{name}'")


def _substitute(tree: Any, values: dict[str, int]) -> Any:
    """``tree`` with the names of ``values`` replaced by them, arithmetic without a name
    folded (a division or remainder that is not exact is left as written)."""
    kind = tree[0]
    if kind == "num":
        return tree
    if kind == "sym":
        return ("num", values[tree[1]]) if tree[1] in values else tree
    parts = tuple(_substitute(t, values) for t in tree[1:])
    if kind in "+-*/%" and all(p[0] == "num" for p in parts):
        try:
            value = ex.evaluate((kind, *parts), {})
        except ArithmeticError:  # inexact, or % 0: left for the checker's bad-when
            return (kind, *parts)
        # the language writes no negative number: 0 - n
        return ("num", value) if value >= 0 else ("-", ("num", 0), ("num", -value))
    return (kind, *parts)


def _mod_value(text: str, env: dict[str, int]) -> int:
    """The value of an index: an expression (dcpc.lang.expr) in which ``%`` by an
    integer constant may end the whole text or a parenthesized part; a part ``(e % n)``
    is replaced by its value first, innermost first, so the shared grammar stays + - * /.
    ValueError (or the expression's errors) when it is not one."""
    if len(text) > ex.MAX_TEXT:  # before the scans below, which are quadratic in it
        raise ValueError(f"the index is longer than {ex.MAX_TEXT} characters")
    while True:
        group = _mod_group(text)
        if group is None:
            break
        start, end = group
        text = f"{text[:start]}{_mod_value(text[start + 1:end], env)}{text[end + 1:]}"
    body, modulus = _split_mod(text)
    if modulus is None:
        return ex.evaluate(ex.parse(body), env)
    node = ex.parse(modulus)
    # one number or one name (W, an integer size: '(r - h) % W'), never more: the right
    # side runs to the ')' or the end, so 'h % 2 + 1' would silently mean h % 3
    if node[0] not in ("num", "sym"):
        lead = re.match(r"\s*([0-9A-Za-z_]+)(.+)", modulus, re.S)  # 'h % 2 + 1'
        raise ValueError(
            "the right side of '%' is everything after it up to the enclosing ')' or the "
            f"index's end, and must be an integer constant or one name (W, an integer "
            f"size); here it is '{modulus.strip()}'" + (
                f": write '({body.strip()} % {lead.group(1)}) {lead.group(2).strip()}' to "
                "take the remainder first" if lead else ""))
    if node[0] == "sym" and node[1] not in env:
        raise ValueError(
            "the right side of '%' must be an integer constant, W or an integer size "
            f"(a name bound when the file is unrolled); here it is '{modulus.strip()}'")
    divisor = ex.evaluate(node, env)
    if node == ("num", 0):
        raise ValueError("'% 0' divides by zero")
    if divisor <= 0:
        raise ValueError(f"'% {modulus.strip()}' is '% {divisor}': a remainder needs a "
                         "positive divisor")
    return _mod_value(body, env) % divisor


def _mod_group(text: str) -> tuple[int, int] | None:
    """(start, end) of the innermost parenthesized part of ``text`` with a ``%`` of its
    own (outside its inner parentheses), or None."""
    opened: list[int] = []
    for i, ch in enumerate(text):
        if ch == "(":
            opened.append(i)
        elif ch == ")" and opened:
            start = opened.pop()
            if _split_mod(text[start + 1:i])[1] is not None:
                return start, i
    return None


def _split_mod(text: str) -> tuple[str, str | None]:
    """``'(h + 1) % 2'`` -> ``('(h + 1) ', ' 2')``: the last ``%`` outside parentheses."""
    depth, cut = 0, -1
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "%" and depth == 0:
            cut = i
    if cut < 0:
        return text, None
    return text[:cut], text[cut + 1:]


def uses_loops(data: Any) -> bool:
    """Whether the raw data has a loop, an indexed buffer name, a shift offset or a
    gather interleave expression anywhere in its steps."""
    if loops(data):
        return True

    def indexed(value: Any) -> bool:
        if _perm(value) is not None:
            return True
        if _offset_expr(value) is not None or _interleave_expr(value) is not None:
            return True
        if _shard(value) is not None:
            return True
        if isinstance(value, str):
            return _INDEXED.match(value.strip()) is not None
        if isinstance(value, list):
            return any(indexed(v) for v in value)
        if isinstance(value, dict):
            return any(indexed(v) for k, v in value.items() if k not in (MARK, MARKS))
        return False

    return isinstance(data, dict) and indexed(data.get("steps"))


def _copies(item: Any, env: dict[str, int],
            owners: frozenset[str] = frozenset({OWNER}),
            rotating: frozenset[str] = frozenset()) -> int:
    """The steps a plain step unrolls to: one per rank (W) when an index of it names the
    rank (``owners`` not bound in ``env``: ``_Unroller.owned``), else one; an index of a
    buffer of ``rotating`` (``_rotating``) written as a rotation (``_rotation_offset``,
    by its form) counts as one step (the unroller's running count is the backstop when
    that buffer is unrolled with copies after all: ``_Unroller.loop``)."""
    named = _body(item)
    owned = (named is not None and isinstance(named[1], dict) and "W" in env
             and _owner_mark(named[1], "<memory>", owners - env.keys(), rotating) is not None)
    return int(env["W"]) if owned else 1


def _rotating(uses: dict[str, Mark | None]) -> frozenset[str]:
    """Of ``_rotation_uses``' buffers, those whose slots an index may take by a rotation
    of the rank (``_Unroller._rotated``): every use of them in the steps an index written
    as a rotation (``_rotation_offset``); a buffer also used whole or indexed otherwise
    is unrolled with copies per rank, and the trip counts' bound counts them so."""
    return frozenset(k for k, v in uses.items() if v is None)


def _rotation_uses(data: Any, env: dict[str, int], file: str = "<memory>"
                   ) -> dict[str, Mark | None]:
    """Each symmetric buffer whose leading axis is W (``_rotating``) -> where the steps
    first use it otherwise than by an index written as a rotation (whole, a fixed
    slice, another index of the rank), None where they never do."""
    buffers = data.get("buffers") if isinstance(data, dict) else None
    if not isinstance(buffers, dict) or "W" not in env:
        return {}
    found: dict[str, Mark | None] = {
        name: None for name, spec in buffers.items()
        if isinstance(spec, dict) and (spec.get("symmetric") or spec.get("shared"))
        and isinstance(spec.get("shape"), list) and len(spec["shape"]) >= 2
        and isinstance(spec["shape"][0], (str, int))
        and env.get(spec["shape"][0], spec["shape"][0]) == env["W"]}
    owners = _owner_names(data)

    def use(value: Any, mark: Mark) -> None:
        if isinstance(value, list):
            for one in value:
                use(one, mark)
        elif isinstance(value, dict):
            for key, one in value.items():
                if key not in (MARK, MARKS):
                    use(one, _mark(value, key, file))
        elif isinstance(value, str):
            indexed = _INDEXED.match(value.strip())
            name = value.strip() if indexed is None else indexed.group(1)
            if found.get(name, mark) is None and (indexed is None or _rotation_offset(
                    indexed.group(2), owners) is None):
                found[name] = mark

    def walk(items: Any) -> None:
        for item in items if isinstance(items, list) else []:
            named = _body(item)
            if named is None or not isinstance(named[1], dict):
                continue
            if _is_loop(named[1]):
                walk(named[1].get("steps"))
                continue
            for key, value in named[1].items():
                if key not in _NOT_SLICES:
                    use(value, _mark(named[1], key, file))

    if found:
        walk(data.get("steps"))
    return found


def _tally(items: list[Any], env: dict[str, int], depth: int, count: list[int],
           owners: frozenset[str] = frozenset({OWNER}),
           rotating: frozenset[str] = frozenset()) -> bool:
    """Add the unrolled steps and the hops of ``items`` (steps at nesting ``depth``, hop
    indices bound in ``env``) to ``count`` = [steps, hops], from the trip counts alone (no
    step is rewritten). A loop's hops are walked only while the hops stay within MAX_HOPS,
    so the work is bounded whatever the trip counts. False where a trip count cannot be
    evaluated, is negative or a loop nests too deep (counted as no steps: the unroller
    reports it)."""
    complete = True

    def copies(item: Any) -> int:
        return _copies(item, env, owners, rotating)

    for item in items:
        named = _body(item)
        if not (named and _is_loop(named[1])):
            count[0] += copies(item)
            continue
        repeat, inner, hop = (named[1].get(k) for k in ("repeat", "steps", "as"))
        if isinstance(repeat, bool) or not isinstance(inner, list) or depth >= MAX_NEST:
            complete = False
            continue
        try:
            trips = ex.evaluate(ex.parse(repeat), env)
        except (ValueError, ArithmeticError, KeyError):  # the unroller says what is wrong
            complete = False
            continue
        if trips < 0:
            complete = False
            continue
        count[1] += trips
        if not any(_is_loop(b[1]) for b in map(_body, inner) if b):  # hops x steps
            count[0] += trips * sum(copies(i) for i in inner)
            continue
        if count[1] > MAX_HOPS:
            continue
        if not isinstance(hop, str):
            complete = False
            continue
        for h in range(trips):
            complete = _tally(inner, {**env, hop: h}, depth + 1, count, owners,
                              rotating) and complete
            if count[1] > MAX_HOPS:
                break
    return complete


def unrolled_length(data: Any, world: int) -> int | None:
    """How many steps the schedule has once unrolled at W = ``world`` (a mesh shape), from
    the trip counts alone (no step is rewritten); None where a trip count cannot be
    evaluated or is negative (the unroller reports that at this W). A nest whose hops
    pass MAX_HOPS counts as MAX_STEPS + 1 at least: refused at this W as well."""
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        return None
    count = [0, 0]
    env = _world_env(data, world)
    if not _tally(steps, env, 0, count, _owner_names(data),
                  _rotating(_rotation_uses(data, env))):
        return None
    return max(count[0], MAX_STEPS + 1) if count[1] > MAX_HOPS else count[0]


def first_too_long(data: Any, worlds: list[int]) -> int | None:
    """The first W of ``worlds`` at which the unrolled schedule would pass the step
    bound (``loop-too-long`` there), found before any W is unrolled or analysed."""
    return next((w for w in worlds if (unrolled_length(data, w) or 0) > MAX_STEPS), None)


# per-W loop files: unrolled steps summed over every W checked (12 x the step bound:
# 6144; the happens-before work of those W, summed, is bounded too: MAX_HB_WORK)
MAX_TOTAL_STEPS = 12 * MAX_STEPS


def widest_within_budget(data: Any, worlds: list[int]) -> tuple[int, int | None]:
    """The unrolled steps summed over ``worlds`` and the largest W up to which the sum
    stays within MAX_TOTAL_STEPS (None: not even the first), from the trip counts alone.
    A per-W file is unrolled and analysed once per W: past this budget one `dcpc check`
    would take seconds (issue 22 item 9), so it is refused at once instead."""
    total, widest = 0, None
    for w in worlds:
        total += unrolled_length(data, w) or 0
        if total <= MAX_TOTAL_STEPS:
            widest = w
    return total, widest


def expand(data: Any, file: str, world: int | None) -> Any:
    """The raw schedule data with every loop unrolled and every indexed buffer split
    (unchanged when it has neither)."""
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        return data  # the model reports what is wrong with it
    if not uses_loops(data):
        return data
    return _Unroller(data, file, world).run()
