"""Stage 1, parse: schedule text -> ``Schedule`` (pydantic) with source marks.

Pydantic's errors are turned into diagnostics at the YAML position they concern;
every error of the file is reported at once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dcpc.diagnostics import Diagnostic, DiagnosticError, Mark, did_you_mean
from dcpc.files import read_capped
from dcpc.lang import loops, model, yamlsrc

_TYPE_NAMES = {
    "int": "an integer",
    "str": "a string",
    "bool": "true or false",
    "list": "a list",
    "dict": "a mapping",
    "string": "a string",
}

MAX_FILE_BYTES = 1 << 20


def parse_file(path: str | Path, world: int | None = None) -> model.Schedule:
    path = Path(path)
    raw = read_capped(path, MAX_FILE_BYTES)  # a regular file of at most 1 MiB, or an error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DiagnosticError(
            [Diagnostic(Mark(str(path), 1, 1), "encoding", f"the file is not UTF-8: {exc.reason}")]
        ) from None
    return parse_text(text, str(path), world)


def parse_text(text: str, file: str = "<memory>", world: int | None = None) -> model.Schedule:
    """``world``: the W that unrolls a loop whose trip count names W (dcpc.lang.loops)."""
    return parse_loaded(yamlsrc.load(text, file), sha256(text), file, world)


def sha256(text: str) -> str:
    """The hash a schedule records of its source text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def parse_loaded(raw: Any, digest: str, file: str, world: int | None) -> model.Schedule:
    """``parse_text`` from the text's loaded YAML (``yamlsrc.load``) and its ``sha256``:
    a file whose loop names W is loaded once and unrolled per W. The model may annotate
    ``raw`` in place: pass a copy of data that is used again."""
    names_world = loops.world_dependent(raw) is not None
    # unrolled steps that read W only serve every shape of that W (LOOP_WORLD = 6 for
    # 2x3); ones that read a mesh axis' size serve that shape only ((2, 3))
    served = loops.loop_world(raw, world) if names_world and world is not None else None
    data = loops.expand(raw, file, world)
    if not isinstance(data, dict):
        raise DiagnosticError(
            [
                Diagnostic(
                    Mark(file, 1, 1),
                    "not-a-mapping",
                    "a schedule is a mapping with keys schedule, sizes, buffers and steps",
                )
            ]
        )
    slices = data.pop(loops.SLICES, {}) if isinstance(data, dict) else {}
    axes = data.pop(loops.SLICE_AXES, {}) if isinstance(data, dict) else {}
    slots = data.pop(loops.SLOT_TEXT, {}) if isinstance(data, dict) else {}
    split = data.pop(loops.SPLIT, {}) if isinstance(data, dict) else {}
    _refuse_too_many(data, file)
    try:
        schedule = model.Schedule.model_validate(data)
    except ValidationError as exc:
        raise DiagnosticError(_diagnostics(exc, data, file)) from None
    schedule.set_source(file, digest)
    schedule._loop_world = served
    schedule._slices = dict(slices)
    schedule._slice_axes = dict(axes)
    schedule._slot_text = dict(slots)
    schedule._sliced = dict(split)
    return schedule


def _refuse_too_many(data: dict[str, Any], file: str) -> None:
    """More steps or buffers than the limits (docs/language.md) are refused before the
    model reads them: each costs every later stage (14,000 buffers took 4 s)."""
    found = []
    for key, limit, what in (("steps", loops.MAX_STEPS, "steps"),
                             ("buffers", model.MAX_BUFFERS, "buffers")):
        value = data.get(key)
        count = len([k for k in value if k not in (yamlsrc.MARK, yamlsrc.MARKS)]) if (
            isinstance(value, (list, dict))) else 0
        if count > limit:
            sliced = " (an indexed buffer counts one per slice)" if key == "buffers" else ""
            found.append(Diagnostic(
                yamlsrc.locate(data, (key,)) or Mark(file, 1, 1), "schedule-too-large",
                f"the schedule has {count} {what}{sliced}, above the limit of {limit}",
                hint="split it into several schedules"))
    if found:
        raise DiagnosticError(found)


_BRANCH_TAGS = ("int", "str", "list[str]", "SizeSpec")


def _is_tag(part: Any) -> bool:
    """Pydantic's union-branch names in an error location (not keys of the data)."""
    return isinstance(part, str) and (
        part in model.OP_NAMES or part in _BRANCH_TAGS or "[" in part
    )


def _where(loc: tuple[Any, ...]) -> str:
    kept = [p for p in loc if not _is_tag(p)]
    parts = [p for p in kept if isinstance(p, str)]
    if parts and kept and isinstance(kept[-1], int):  # a list item: 'buffers.x.shape[1]'
        parts[-1] += f"[{kept[-1]}]"
    return "'" + ".".join(parts) + "'" if parts else "the schedule"


def _model_fields_at(data: dict[str, Any], loc: tuple[Any, ...]) -> list[str]:
    """Names of the keys allowed where an unknown key was found (for 'did you mean')."""
    parent = loc[:-1]
    if not parent:
        return [k for k in _aliases(model.Schedule) if not k.startswith("source_")]
    head = parent[0]
    if head == "buffers" and len(parent) == 2:
        return _aliases(model.Buffer)
    if head == "sizes":
        return _aliases(model.SizeSpec)
    if head == "steps":
        op_model = _op_model(parent)
        if op_model is not None:
            if parent[-1] == "mask_empty":
                return _aliases(model.MaskEmpty)
            return _aliases(op_model)
    return []


def _aliases(cls: type[model.Node]) -> list[str]:
    return [f.alias or name for name, f in cls.model_fields.items() if not name.startswith("src_")]


def _op_model(loc: tuple[Any, ...]) -> type[model.Node] | None:
    for part in loc:
        if part in model.OP_NAMES:
            for cls in model.OpBase.__subclasses__():
                if cls.model_fields["op"].annotation.__args__[0] == part:  # type: ignore
                    return cls
    return None


_UNION_WANTS = {
    frozenset({"str", "list[str]"}): "a name or a list of names",
    frozenset({"int", "str"}): "an integer or a size expression such as 'H/W'",
}


def _collapse_unions(errors: list[Any], data: dict[str, Any], file: str) -> tuple[
    list[Any], list[Diagnostic]
]:
    """One message per value that matches no branch of a plain union (``src: 3``).

    Pydantic reports one error per branch. When the input is a list and a list
    branch exists, only the errors inside the list are kept (they name the bad
    item); otherwise the branches' type errors become one "must be A or B" message.
    """
    groups: dict[tuple[Any, ...], list[tuple[str, Any]]] = {}
    rest: list[Any] = []
    for err in errors:
        loc = tuple(err["loc"])
        cut = next((i for i, p in enumerate(loc) if p in ("int", "str", "list[str]")), None)
        if cut is None or (loc[:1] == ("sizes",) and cut == 2):  # int | SizeSpec: below
            rest.append(err)
            continue
        groups.setdefault(loc[:cut], []).append((loc[cut], err))
    out: list[Diagnostic] = []
    for prefix, members in groups.items():
        tags = frozenset(tag for tag, _ in members)
        if len(tags) < 2 or tags not in _UNION_WANTS:
            rest += [err for _, err in members]
            continue
        deeper = [err for tag, err in members if len(err["loc"]) > len(prefix) + 1]
        if "list[str]" in tags and deeper:
            rest += deeper
            continue
        value = members[0][1].get("input")
        got = "empty" if value is None else type(value).__name__
        got = _TYPE_NAMES.get(got, got) if value != [] else "an empty list"  # (min_length)
        mark = yamlsrc.locate(data, prefix) or Mark(file, 1, 1)
        out.append(Diagnostic(
            mark, "wrong-type", f"{_where(prefix)} must be {_UNION_WANTS[tags]}, not {got}",
        ))
    return rest, out


def _diagnostics(exc: ValidationError, data: dict[str, Any], file: str) -> list[Diagnostic]:
    errors, out = _collapse_unions(exc.errors(include_url=False), data, file)
    seen: set[tuple[Mark, str]] = {(d.mark, d.message) for d in out}
    for err in errors:
        loc = tuple(err["loc"])
        kind = err["type"]
        if loc[:1] == ("sizes",) and len(loc) >= 3 and _is_tag(loc[2]):
            # int | SizeSpec: report the branch that matches the input's shape only
            is_mapping = isinstance(yamlsrc.strip(data.get("sizes", {})).get(loc[1]), dict)
            if is_mapping != (loc[2] != "int"):
                continue
            if not is_mapping:
                mark = yamlsrc.locate(data, loc) or Mark(file, 1, 1)
                out.append(Diagnostic(
                    mark, "wrong-type",
                    f"size '{loc[1]}' must be an integer or a mapping with 'max' "
                    "and/or 'multiple_of'",
                    hint="for example 'T: {max: 512}', 'H: {multiple_of: W}' or 'D: 576'",
                ))
                continue
        mark = yamlsrc.locate(data, loc, key=kind == "extra_forbidden") or Mark(file, 1, 1)
        diag = _one(err, kind, loc, mark, data)
        if diag is not None and (diag.mark, diag.message) not in seen:
            seen.add((diag.mark, diag.message))
            out.append(diag)
    return out


def _one(
    err: Any, kind: str, loc: tuple[Any, ...], mark: Mark, data: dict[str, Any]
) -> Diagnostic | None:
    where = _where(loc)
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _model_fields_at(data, loc)
        return Diagnostic(
            mark, "unknown-key", f"unknown key '{key}' in {_where(loc[:-1])}",
            hint=did_you_mean(key, allowed)
            or (f"allowed keys: {', '.join(sorted(allowed))}" if allowed else None),
        )
    if kind == "missing":
        return Diagnostic(mark, "missing-key", f"{where} is required but missing")
    if kind == "union_tag_invalid":
        tag = err.get("ctx", {}).get("tag", "?")
        return Diagnostic(
            mark, "unknown-op", f"unknown op '{tag}'",
            hint=did_you_mean(str(tag), model.OP_NAMES)
            or f"ops are: {', '.join(model.OP_NAMES)}",
        )
    if kind == "union_tag_not_found":
        return Diagnostic(
            mark, "missing-op", "this step has no 'op' key",
            hint=f"add 'op:' with one of {', '.join(model.OP_NAMES)}",
        )
    if kind == "enum" or kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return Diagnostic(
            mark, "bad-value", f"{where} is {err.get('input')!r}, expected one of {expected}"
        )
    if kind.endswith("_type") or kind in ("model_type", "model_attributes_type"):
        want = kind.removesuffix("_type")
        want_text = _TYPE_NAMES.get(want, "a mapping" if "model" in kind else want)
        got = type(err.get("input")).__name__
        if got in ("NoneType",):
            got = "empty"
        if "union" in kind or want == "union":
            return None
        return Diagnostic(
            mark, "wrong-type", f"{where} must be {want_text}, not {_TYPE_NAMES.get(got, got)}"
        )
    if kind in ("too_short", "too_long"):
        return Diagnostic(mark, "wrong-length", f"{where}: {err['msg'].lower()}")
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return Diagnostic(mark, "out-of-range", f"{where}: {err['msg'].lower()}")
    if kind == "value_error":
        message = str(err.get("ctx", {}).get("error", err["msg"]))
        return Diagnostic(mark, "bad-value", f"{where}: {message}")
    return Diagnostic(mark, "invalid", f"{where}: {err['msg']}")
