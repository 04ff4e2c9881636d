"""The contract an engine's DCP code holds dcpc's adapters to, read from source.

dcpc replaces an engine's functions and its manager class. What the engine's code may
use of them is a surface: each function's parameters (names, positions, defaults), the
manager's public attributes and methods (every ``self.NAME = ...`` of its methods, its
properties and class attributes, across its bases) and the methods' parameters. Two
readings of it:

- ``class_surface(cls)`` / ``compare_class`` / ``compare_callable``: what the engine's
  own class and functions provide, compared with dcpc's (``install()`` does it for
  every piece it replaces: a difference keeps the engine's piece and names it);
- ``uses_in_source`` / ``check_uses``: what the engine's modules actually read off a
  manager object (``x.dcp_manager.NAME``) and pass to the replaced callables (every
  keyword, the number of positional arguments), found in their source, and whether
  dcpc's callables take exactly that. ``python -m dcpc.engines.contract PATH`` runs it
  over an engine's source tree (a folder or a wheel) and prints what dcpc lacks.

Both are static (``ast``): nothing of the engine is executed.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_ATTRIBUTE_DECORATORS = ("property", "cached_property", "setter", "getter", "deleter")


# ---- what a class provides ------------------------------------------------------------------
@dataclass
class Surface:
    """A class's public surface: ``attributes`` (instance attributes its methods set,
    properties, class attributes) and ``methods`` (plain methods, ``__init__``
    included); ``unread`` names the classes whose source could not be read (their
    instance attributes are then unknown)."""

    attributes: set[str] = field(default_factory=set)
    methods: set[str] = field(default_factory=set)
    unread: list[str] = field(default_factory=list)

    def names(self) -> set[str]:
        return self.attributes | self.methods


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute):
            out.add(d.attr)
        elif isinstance(d, ast.Name):
            out.add(d.id)
    return out


def _self_targets(target: ast.AST, self_name: str) -> Iterator[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _self_targets(t, self_name)
    elif isinstance(target, ast.Starred):
        yield from _self_targets(target.value, self_name)
    elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
          and target.value.id == self_name):
        yield target.attr


def _class_node(klass: type) -> ast.ClassDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return None
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
            return node
    return None


def class_surface(cls: type) -> Surface:
    """The public surface of ``cls`` and its bases (``object`` and classes of the
    standard library's ``typing``/``abc`` excluded), read from their source; a class
    without readable source contributes what ``vars()`` shows and is named in
    ``unread``."""
    s = Surface()
    for klass in cls.__mro__:
        if klass is object or klass.__module__ in ("typing", "abc", "builtins"):
            continue
        node = _class_node(klass)
        if node is None:
            s.unread.append(f"{klass.__module__}.{klass.__qualname__}")
            for name, value in vars(klass).items():
                if _public(name):
                    (s.methods if inspect.isfunction(value) else s.attributes).add(name)
            continue
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _decorator_names(item) & set(_ATTRIBUTE_DECORATORS):
                    if _public(item.name):
                        s.attributes.add(item.name)
                elif _public(item.name):
                    s.methods.add(item.name)
                args = item.args.posonlyargs + item.args.args
                if not args or "staticmethod" in _decorator_names(item):
                    continue
                me = args[0].arg
                for sub in ast.walk(item):
                    targets: list[ast.AST] = []
                    if isinstance(sub, ast.Assign):
                        targets = list(sub.targets)
                    elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                        targets = [sub.target]
                    for t in targets:
                        s.attributes.update(n for n in _self_targets(t, me) if _public(n))
            elif isinstance(item, ast.Assign):
                for t in item.targets:
                    if isinstance(t, ast.Name) and _public(t.id):
                        s.attributes.add(t.id)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and _public(item.target.id):
                s.attributes.add(item.target.id)
    s.attributes -= s.methods  # a method that is also assigned stays a method
    return s


# ---- comparing callables --------------------------------------------------------------------
def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == is not a bool: not the same
        return False


def _params(fn: Any, drop_self: bool) -> list[inspect.Parameter] | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:] if drop_self and params else params


def compare_callable(label: str, theirs: Any, mine: Any, *, method: bool = False,
                     engine_only: Mapping[str, Any] = {}) -> list[str]:
    """Why ``mine`` cannot stand in for ``theirs`` under the engine's calls ([] when it
    can): every parameter of theirs must be one of mine, at the same position when it
    can be passed by position, keyword-only where theirs is, with theirs' default when
    it has one; a parameter of mine that theirs lacks must have a default (unless theirs
    takes ``*args`` or ``**kwargs``: what its callers pass is then unknown). A parameter
    in ``engine_only`` (with the value at which dcpc runs the call) may instead fall
    into mine's ``**kwargs``. ``method``: both are methods read off a class (self is
    dropped). A callable whose signature cannot be read compares as unknown: []."""
    ts, ms = _params(theirs, method), _params(mine, method)
    if ts is None or ms is None:
        return []
    diffs: list[str] = []
    named = {p.name: p for p in ms if p.kind not in _VARIADIC}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ms)
    t_pos = [p.name for p in ts if p.kind in _POSITIONAL]
    m_pos = [p.name for p in ms if p.kind in _POSITIONAL]
    for p in ts:
        if p.kind in _VARIADIC:
            continue
        q = named.get(p.name)
        if q is None:
            if p.name in engine_only and var_kw:
                if p.default is not _EMPTY and not _same(p.default, engine_only[p.name]):
                    diffs.append(f"{label}: vLLM's {p.name}={p.default!r} by default, dcpc "
                                 f"runs the call at {p.name}={engine_only[p.name]!r} only")
                continue
            diffs.append(f"{label}: parameter {p.name!r} is vLLM's, not dcpc's")
            continue
        if p.kind in _POSITIONAL:
            where = t_pos.index(p.name)
            if q.kind not in _POSITIONAL or m_pos.index(q.name) != where:
                diffs.append(f"{label}: parameter {p.name!r} is vLLM's positional argument "
                             f"{where}, not dcpc's")
        if p.default is not _EMPTY:
            if q.default is _EMPTY:
                diffs.append(f"{label}: parameter {p.name!r} has a default in vLLM "
                             f"({p.default!r}), none in dcpc")
            elif not _same(p.default, q.default):
                diffs.append(f"{label}: parameter {p.name!r} defaults to {p.default!r} in "
                             f"vLLM, to {q.default!r} in dcpc")
    theirs_names = {p.name for p in ts}
    if any(p.kind in _VARIADIC for p in ts):  # theirs takes more than it names: unknown
        return diffs
    for q in ms:
        if q.kind not in _VARIADIC and q.default is _EMPTY and q.name not in theirs_names:
            diffs.append(f"{label}: dcpc requires {q.name!r}, which vLLM's callers do not "
                         "pass")
    return diffs


def callable_of(cls: type, name: str) -> Any:
    """The callable dcpc's class offers as ``name``: its method, or the method its
    ``CALLABLE_ATTRIBUTES`` names for an instance attribute that holds a bound method
    (or None)."""
    alias = getattr(cls, "CALLABLE_ATTRIBUTES", {}).get(name)
    found = getattr(cls, alias or name, None)
    return found if callable(found) else None


def compare_class(label: str, theirs: type, mine: type) -> list[str]:
    """Why dcpc's class ``mine`` cannot stand in for the engine's ``theirs`` ([] when it
    can): every public name of theirs (class_surface) must be one of mine, theirs'
    methods (``__init__`` too) compared with mine's as compare_callable does."""
    ts, ms = class_surface(theirs), class_surface(mine)
    diffs = []
    for name in sorted(ts.names()):
        if name not in ms.names():
            kind = "method" if name in ts.methods else "attribute"
            diffs.append(f"{label}.{name}: vLLM's {kind}, not dcpc's")
            continue
        if name in ts.methods:
            ours = callable_of(mine, name)
            if ours is not None:
                diffs += compare_callable(f"{label}.{name}", getattr(theirs, name), ours,
                                          method=True)
    diffs += [f"{label}: the source of {c} could not be read (its instance attributes are "
              "not compared)" for c in ts.unread]
    return diffs


# ---- what the engine's modules use ------------------------------------------------------------
@dataclass(frozen=True)
class Use:
    """One use in the engine's source: ``kind`` "attribute" (a read ``x.dcp_manager.name``)
    or "call" (a call of ``name``: a replaced function, the manager class, or
    ``x.dcp_manager.name(...)`` with ``on_manager``); ``positional`` the number of
    positional arguments (None: a ``*args``), ``keywords`` their names, ``partial``
    when the call is ``functools.partial(name, ...)`` (keywords bound, more to come)."""

    where: str
    kind: str
    name: str
    on_manager: bool = False
    positional: int | None = 0
    keywords: tuple[str, ...] = ()
    partial: bool = False


def _is_manager(node: ast.AST, names: Iterable[str]) -> bool:
    names = set(names)
    return ((isinstance(node, ast.Name) and node.id in names)
            or (isinstance(node, ast.Attribute) and node.attr in names))


def _call_use(where: str, call: ast.Call, name: str, on_manager: bool,
              partial: bool = False) -> Use:
    args = call.args[1:] if partial else call.args
    positional = None if any(isinstance(a, ast.Starred) for a in args) else len(args)
    keywords = tuple(k.arg for k in call.keywords if k.arg is not None)
    return Use(where, "call", name, on_manager, positional, keywords, partial)


def _named(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr \
        if isinstance(node, ast.Attribute) else None


def _referenced(value: ast.AST, functions: set[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The replaced functions an assigned value may hold, with the keywords it binds:
    ``NAME``, ``partial(NAME, k=...)``, ``A if c else B`` (both)."""
    if isinstance(value, ast.IfExp):
        return _referenced(value.body, functions) + _referenced(value.orelse, functions)
    if isinstance(value, ast.Call) and _named(value.func) == "partial" and value.args:
        inner = _named(value.args[0])
        if inner in functions:
            return [(inner, tuple(k.arg for k in value.keywords if k.arg is not None))]
        return []
    name = _named(value)
    return [(name, ())] if name in functions else []


def uses_in_source(text: str, filename: str, functions: Iterable[str],
                   manager_names: Iterable[str] = ("dcp_manager",)) -> list[Use]:
    """Every read off a manager object (an expression named ``dcp_manager``: a variable
    or an attribute) and every call of one of ``functions`` in one module's source: a
    plain or attribute call (``NAME(...)``, ``ops.NAME(...)``), ``functools.partial(NAME,
    ...)``, and a call through a name the module assigned one to (``self.combine =
    NAME_A if c else NAME_B`` or ``partial(NAME, k=v)``, then ``self.combine(...)``:
    a call of each, the partial's keywords included)."""
    functions = set(functions)
    try:
        tree = ast.parse(text, filename)
    except SyntaxError:
        return []
    aliases: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            found = _referenced(node.value, functions)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                name = _named(t)
                if found and name is not None and name not in functions:
                    aliases.setdefault(name, []).extend(found)
    uses: list[Use] = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and _is_manager(node.value, manager_names) \
                and isinstance(node.ctx, ast.Load):
            uses.append(Use(where, "attribute", node.attr, True))
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and _is_manager(f.value, manager_names):
            uses.append(_call_use(where, node, f.attr, True))
            continue
        name = _named(f)
        if name in functions:
            uses.append(_call_use(where, node, name, False))
        elif name == "partial" and node.args:
            inner = _named(node.args[0])
            if inner in functions:
                uses.append(_call_use(where, node, inner, False, partial=True))
        elif name in aliases:
            call = _call_use(where, node, name, False)
            for target, bound in aliases[name]:
                uses.append(Use(where, "call", target, False, call.positional,
                                (*bound, *call.keywords)))
    return uses


def _binds(fn: Any, use: Use, method: bool, engine_only: Mapping[str, Any]) -> str | None:
    """Why ``fn`` cannot take the arguments of ``use`` (None when it can): the keywords
    must be named parameters (or in ``engine_only``), the positional count must fit."""
    params = _params(fn, method)
    if params is None:
        return None
    named = {p.name: p for p in params if p.kind not in _VARIADIC}
    for k in use.keywords:
        p = named.get(k)
        if p is None and k not in engine_only:
            return f"keyword {k!r} is not a parameter of dcpc's"
        if p is not None and p.kind is inspect.Parameter.POSITIONAL_ONLY:
            return f"keyword {k!r} is positional-only in dcpc's"
    if use.positional is not None:
        positional = [p for p in params if p.kind in _POSITIONAL]
        if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params) and \
                use.positional > len(positional):
            return f"{use.positional} positional arguments, dcpc's takes {len(positional)}"
        taken = {p.name for p in positional[: use.positional]}
        if taken & set(use.keywords):
            return f"{sorted(taken & set(use.keywords))} passed twice"
        if not use.partial:
            missing = [p.name for p in params if p.default is _EMPTY and p.kind not in
                       _VARIADIC and p.name not in taken and p.name not in use.keywords]
            if missing:
                return f"dcpc's requires {missing}, not passed"
    return None


def check_uses(uses: Iterable[Use], manager: type, functions: Mapping[str, Any],
               engine_only: Mapping[str, Any] = {}) -> list[str]:
    """What dcpc lacks for ``uses``: an attribute read off the manager that dcpc's
    ``manager`` class does not provide (class_surface), a call whose arguments dcpc's
    callable does not take (keywords named, positional count, required parameters):
    ``functions`` maps each replaced name (the manager class's name too) to dcpc's."""
    surface = class_surface(manager)
    missing: list[str] = []
    for use in uses:
        if use.on_manager:
            if use.name not in surface.names():
                missing.append(f"{use.where}: {use.kind} {use.name!r} of the manager: not "
                               "dcpc's")
                continue
            if use.kind == "call":
                fn = callable_of(manager, use.name)
                why = None if fn is None else _binds(fn, use, True, {})
                if fn is None:
                    why = "dcpc's attribute is not callable"
                if why:
                    missing.append(f"{use.where}: manager.{use.name}(...): {why}")
            continue
        fn = functions.get(use.name)
        if fn is None:
            continue
        method = isinstance(fn, type)
        why = _binds(fn.__init__ if method else fn, use, method, engine_only)
        if why:
            missing.append(f"{use.where}: {use.name}(...): {why}")
    return missing


def source_files(path: Path, package: str = "vllm") -> Iterator[tuple[str, str]]:
    """(name, text) of every ``.py`` file of ``package`` under ``path``: a folder (the
    package's parent, e.g. site-packages) or a wheel."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():
                if member.startswith(f"{package}/") and member.endswith(".py"):
                    yield member, z.read(member).decode("utf-8", "replace")
        return
    root = path / package if (path / package).is_dir() else path
    for file in sorted(root.rglob("*.py")):
        yield str(file.relative_to(root.parent)), file.read_text("utf-8", "replace")


def scan(files: Iterable[tuple[str, str]], functions: Iterable[str],
         keep: Callable[[str], bool] = lambda text: "dcp" in text) -> list[Use]:
    """uses_in_source over many files, parsing only those ``keep`` accepts (cheap)."""
    functions = list(functions)
    uses: list[Use] = []
    for name, text in files:
        if keep(text):
            uses += uses_in_source(text, name, functions)
    return uses


def main(argv: list[str] | None = None) -> int:
    """``python -m dcpc.engines.contract PATH``: what vLLM's source at PATH (a wheel, or
    the folder holding the ``vllm`` package) reads off its DCP manager and passes to
    the functions dcpc replaces, and what of it dcpc's adapters lack. Exit 1 when
    something is lacking."""
    # the adapters (torch and all) only for the command: the readers above need none
    from dcpc.engines.vllm_free import ENGINE_ONLY
    from dcpc.engines.vllm_manager import MLADCPManager
    from dcpc.engines.vllm_pieces import replacements

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dcpc.engines.contract PATH (a vLLM wheel or the folder "
              "holding the vllm package)", file=sys.stderr)
        return 2
    path = Path(args[0])
    if not path.exists():
        print(f"error: {path}: no such file or folder", file=sys.stderr)
        return 2
    functions = replacements()
    try:
        uses = scan(source_files(path), functions)
    except (OSError, zipfile.BadZipFile) as err:
        print(f"error: {path}: cannot be read ({type(err).__name__}: {err})", file=sys.stderr)
        return 2
    missing = check_uses(uses, MLADCPManager, functions, ENGINE_ONLY)
    print(f"{len(uses)} uses of the manager and of {', '.join(sorted(functions))}")
    for line in missing:
        print(f"missing: {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["Surface", "Use", "callable_of", "check_uses", "class_surface",
           "compare_callable", "compare_class", "main", "scan", "source_files",
           "uses_in_source"]
