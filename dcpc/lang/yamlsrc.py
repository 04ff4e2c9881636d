"""Safe YAML loading that keeps the source mark of every node.

Only PyYAML's safe composer is used: no tags are honoured beyond the core scalars,
so nothing in a schedule can construct a Python object. Every mapping becomes a
plain dict with two extra entries the models understand:

- ``__mark__``: the mark of the mapping itself;
- ``__marks__``: ``{key: mark of its value, "key:" + key: mark of the key,
  key + "[i]": mark of list item i}``.
"""

from __future__ import annotations

from typing import Any

import yaml

from dcpc.diagnostics import Diagnostic, DiagnosticError, Mark
from dcpc.lang.expr import MAX_INT_DIGITS

MARK = "__mark__"
MARKS = "__marks__"
# the language's bound on steps (dcpc check refuses more: schedule-too-large); defined here,
# the lowest layer that states it (the hint below), and read as dcpc.lang.loops.MAX_STEPS
MAX_STEPS = 512
# about twice what the other limits admit: e.g. 512 steps naming 40 buffers 19,382 times,
# near the accesses' limit, are 24,277 nodes (benchmarks/check_steps_bound.py's accesses)
NODE_BUDGET = 50_000
# No integer of a schedule needs more than MAX_INT_DIGITS (an expression's integers have
# the same bound): the language's own bounds (sizes, dims) are far smaller and are
# checked later. Bounding here keeps Python's int/str limit (4,300 digits) and huge
# values out of every later stage and every message.
INT_TAG = "tag:yaml.org,2002:int"
_TOO_LARGE_HINT = (f"a schedule needs far fewer (at most {MAX_STEPS} steps): split it, or "
                   "remove what the schema does not read")
_TAG_NAMES = {
    "tag:yaml.org,2002:int": "an integer", "tag:yaml.org,2002:float": "a number",
    "tag:yaml.org,2002:bool": "true or false", "tag:yaml.org,2002:null": "empty",
    "tag:yaml.org,2002:timestamp": "a date or time", "tag:yaml.org,2002:binary": "base64 data",
}


def _mark(file: str, node: yaml.Node) -> Mark:
    return Mark(file, node.start_mark.line + 1, node.start_mark.column + 1)


class _Builder:
    def __init__(self, file: str):
        self.file = file
        self.constructor = yaml.SafeLoader("")  # only used to construct scalars
        self.errors: list[Diagnostic] = []
        self.budget = NODE_BUDGET
        self.seen: set[int] = set()  # collections built once: seeing one again is an alias
        self.aliased = False

    def value(self, node: yaml.Node) -> Any:
        self.budget -= 1
        if self.budget < 0:  # aliases can expand exponentially ("billion laughs")
            raise DiagnosticError([self._too_large(node)])
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            self.aliased |= id(node) in self.seen
            self.seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node)
        if isinstance(node, yaml.SequenceNode):
            return [self.value(item) for item in node.value]
        if isinstance(node, yaml.MappingNode):
            return self.mapping(node)
        raise AssertionError(f"unexpected YAML node {node!r}")

    def _too_large(self, node: yaml.Node) -> Diagnostic:
        if self.aliased:
            return Diagnostic(_mark(self.file, node), "yaml-too-large",
                              f"the schedule expands to more than {NODE_BUDGET} YAML nodes",
                              hint="do not nest anchors and aliases")
        return Diagnostic(_mark(self.file, node), "yaml-too-large",
                          f"the schedule has more than {NODE_BUDGET} YAML nodes (here the "
                          "limit is passed)", hint=_TOO_LARGE_HINT)

    def key(self, node: yaml.ScalarNode) -> str | None:
        """A mapping key as the name it is written as; a key YAML reads as a number
        other than an integer, a boolean or null is refused (``.inf: 4`` under sizes
        would otherwise declare a size 'inf', ``yes:`` one named 'True')."""
        value = self.value(node)
        if value is None and node.tag != "tag:yaml.org,2002:null":
            return None  # its error is already reported
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
        kind = _TAG_NAMES.get(node.tag, "a value that is not a name")
        self.errors.append(Diagnostic(
            _mark(self.file, node), "yaml-key",
            f"the key {node.value!r} reads as {kind} in YAML, not as a name",
            hint=f"write a name; quote it (\"{node.value}\") only if it is meant as text",
        ))
        return None

    def scalar(self, node: yaml.ScalarNode) -> Any:
        """A scalar's value; a tag whose text it cannot read is a located diagnostic."""
        text = node.value if isinstance(node.value, str) else ""
        if node.tag == INT_TAG and len(text.strip().lstrip("+-").replace("_", "")) > (
            MAX_INT_DIGITS
        ):
            self.errors.append(Diagnostic(
                _mark(self.file, node), "number-too-large",
                f"this integer has more than {MAX_INT_DIGITS} digits",
                hint="sizes and dimensions are at most 2**31-1 (see docs/language.md, Limits)",
            ))
            return None
        try:
            value = self.constructor.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError:  # a tag no safe constructor knows
            self.errors.append(Diagnostic(
                _mark(self.file, node), "yaml-syntax",
                f"invalid YAML: the tag {node.tag!r} is not allowed",
                hint="only YAML's core tags are read (!!str, !!int, !!float, !!bool, !!null)",
            ))
            return None
        except Exception:  # noqa: BLE001 (PyYAML's scalar constructors raise anything)
            want = _TAG_NAMES.get(node.tag, f"a value of tag {node.tag}")
            shown = text if len(text) <= 40 else text[:40] + "..."
            self.errors.append(Diagnostic(
                _mark(self.file, node), "bad-tag-value",
                f"{shown!r} is not {want}",
                hint="remove the tag (the schema says what each key takes) or fix the value",
            ))
            return None
        if isinstance(value, int) and not isinstance(value, bool) and (
            abs(value) >= 10**MAX_INT_DIGITS
        ):  # a hexadecimal, octal or sexagesimal integer of few digits but a huge value
            self.errors.append(Diagnostic(
                _mark(self.file, node), "number-too-large",
                f"this integer has more than {MAX_INT_DIGITS} digits",
                hint="sizes and dimensions are at most 2**31-1 (see docs/language.md, Limits)",
            ))
            return None
        return value

    def mapping(self, node: yaml.MappingNode) -> dict[str, Any]:
        out: dict[str, Any] = {MARK: _mark(self.file, node)}
        marks: dict[str, Mark] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.errors.append(
                    Diagnostic(
                        _mark(self.file, key_node),
                        "yaml-key",
                        "a mapping key must be a plain name, not a list or a mapping",
                    )
                )
                continue
            key = self.key(key_node)
            if key is None:
                continue
            if key.startswith("__"):
                self.errors.append(
                    Diagnostic(
                        _mark(self.file, key_node),
                        "reserved-key",
                        f"keys starting with '__' are reserved, found '{key}'",
                    )
                )
                continue
            if key in marks:
                self.errors.append(
                    Diagnostic(
                        _mark(self.file, key_node),
                        "duplicate-key",
                        f"key '{key}' appears twice in this mapping",
                        hint=f"the first '{key}' is at line {marks['key:' + key].line}; "
                        "remove one of them",
                    )
                )
                continue
            marks["key:" + key] = _mark(self.file, key_node)
            marks[key] = _mark(self.file, value_node)
            if isinstance(value_node, yaml.SequenceNode):
                for i, item in enumerate(value_node.value):
                    marks[f"{key}[{i}]"] = _mark(self.file, item)
            out[key] = self.value(value_node)
        out[MARKS] = marks
        return out


def position_mark(text: str, file: str, position: int) -> Mark:
    """The 1-based line and column of a character offset into ``text``."""
    position = max(0, min(position, len(text)))
    line = text.count("\n", 0, position) + 1
    start = text.rfind("\n", 0, position) + 1
    return Mark(file, line, position - start + 1)


# libyaml's parser (PyYAML's C binding) when it is installed: the pure-Python one took
# 1 s for a file of 20,000 buffer names and 35 s to refuse a 1 MiB list (issue 31), ten
# times libyaml's time; libyaml also bounds nesting at 1000 levels, without recursion.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_TOO_DEEP = "exceeded maximum nesting depth"  # libyaml's words for its nesting bound


def load(text: str, file: str) -> Any:
    """Parse YAML text into plain data with marks; raise DiagnosticError on bad YAML."""
    try:
        _count_events(text, file)
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        where = exc.problem_mark or exc.context_mark
        mark = Mark(file, where.line + 1, where.column + 1) if where else Mark(file, 1, 1)
        what = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
        if _TOO_DEEP in what:
            raise DiagnosticError([Diagnostic(
                Mark(file, 1, 1), "yaml-too-deep",
                f"the YAML is nested too deeply (more than 1000 levels; at line {mark.line})",
            )]) from None
        found = _char_at(text, where) if where else None
        if found is not None and "found character" in what and repr(found) not in what:
            what = what.replace("found character", f"found character {found!r}", 1)
        raise DiagnosticError(
            [Diagnostic(mark, "yaml-syntax", f"invalid YAML: {what}")]
        ) from None
    except yaml.reader.ReaderError as exc:  # a control character YAML does not allow
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        raise DiagnosticError([Diagnostic(
            position_mark(text, file, exc.position), "yaml-syntax",
            f"invalid YAML: the control character {char!r} is not allowed",
            hint="remove it; inside a double-quoted string write it as an escape such as \\t",
        )]) from None
    except yaml.YAMLError as exc:
        what = " ".join(str(exc).split())
        raise DiagnosticError(
            [Diagnostic(Mark(file, 1, 1), "yaml-syntax", f"invalid YAML: {what}")]
        ) from None
    except RecursionError:  # PyYAML composes recursively: "[[[[..." exhausts the stack
        raise DiagnosticError(
            [Diagnostic(Mark(file, 1, 1), "yaml-too-deep", "the YAML is nested too deeply")]
        ) from None
    if node is None:
        raise DiagnosticError(
            [Diagnostic(Mark(file, 1, 1), "empty-file", "the schedule file is empty")]
        )
    builder = _Builder(file)
    try:
        data = builder.value(node)
    except RecursionError:
        raise DiagnosticError(
            [Diagnostic(Mark(file, 1, 1), "yaml-too-deep", "the YAML is nested too deeply")]
        ) from None
    if builder.errors:
        raise DiagnosticError(builder.errors)
    return data


def _count_events(text: str, file: str) -> None:
    """Refuse a file of more than NODE_BUDGET nodes before composing it: each node is
    one or two parser events (a scalar or alias; a collection's start and end), and
    the events cost a tenth of the nodes (a 1 MiB list took 35 s to compose and refuse).
    Aliases, one event each, are counted as they expand, by ``_Builder``."""
    limit = 2 * NODE_BUDGET + 4  # + the stream's and the document's start and end
    for count, event in enumerate(yaml.parse(text, Loader=_LOADER)):
        if count > limit:
            mark = Mark(file, event.start_mark.line + 1, event.start_mark.column + 1)
            raise DiagnosticError([Diagnostic(
                mark, "yaml-too-large",
                f"the schedule has more than {NODE_BUDGET} YAML nodes (here the limit is "
                "passed)", hint=_TOO_LARGE_HINT)])


def _char_at(text: str, mark: Any) -> str | None:
    """The character a YAML error's mark points at (libyaml's messages do not name it)."""
    lines = text.split("\n", mark.line + 1)
    if mark.line >= len(lines) or mark.column >= len(lines[mark.line]):
        return None
    return lines[mark.line][mark.column]


def strip(data: Any) -> Any:
    """The same data without marks (for schema validation and printing)."""
    if isinstance(data, dict):
        return {k: strip(v) for k, v in data.items() if k not in (MARK, MARKS)}
    if isinstance(data, list):
        return [strip(v) for v in data]
    return data


def locate(data: Any, loc: tuple[Any, ...], *, key: bool = False) -> Mark | None:
    """The mark of the node at ``loc`` (a pydantic error location) in marked data.

    Elements of ``loc`` that are not keys of the data (pydantic's union tags) are
    skipped. With ``key=True`` the last element's key mark is returned.
    """
    best: Mark | None = data.get(MARK) if isinstance(data, dict) else None
    current = data
    parent: dict[str, Any] | None = None
    parent_key: str | None = None
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(current, dict) and isinstance(part, str) and part in current:
            marks = current.get(MARKS, {})
            best = marks.get("key:" + part if (key and last) else part, best)
            parent, parent_key, current = current, part, current[part]
        elif isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current):
            item = current[part]
            if isinstance(item, dict) and MARK in item:
                best = item[MARK]
            elif parent is not None:
                best = parent.get(MARKS, {}).get(f"{parent_key}[{part}]", best)
            current = item
        elif isinstance(current, dict) and key and last and isinstance(part, str):
            best = current.get(MARKS, {}).get("key:" + part, best)
    return best
