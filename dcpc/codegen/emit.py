"""Stage 5, emit: ``Plan`` -> the text of one Python module (Jinja templates).

Templates get the plan (identifiers, integers, enums, shape ASTs) and a few filters:
``py`` writes a literal in ruff-format style, ``docstring`` escapes free text so that
quotes, backslashes, ``\"\"\"`` or template syntax in a doc can never leave the string.
The output is deterministic (no timestamps, no set iteration) and ruff-format clean.
"""

from __future__ import annotations

import re
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from dcpc.codegen.plan import Plan, StepPlan
from dcpc.codegen.templates import template_dir
from dcpc.lang.mesh import MeshWorld

WIDTH = 100
TL_DTYPES = {
    "bf16": "tl.bfloat16",
    "f16": "tl.float16",
    "f32": "tl.float32",
    "i32": "tl.int32",
    "i64": "tl.int64",
    "fp8e4m3": "tl.float8e4nv",
    "fp8e5m2": "tl.float8e5",
}
# a condition's operators (when:, dcpc.exprs) too: no quote, backslash or newline
_SAFE_STR = re.compile(r"[A-Za-z0-9_./:+\-*%<>=! ]*\Z")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Ident(str):
    """A name that ``py`` writes bare (a variable), not as a string literal."""


def py(obj: Any, indent: int = 0, prefix: int = 0, suffix: int = 0) -> str:
    """A Python literal of ints, safe strings, tuples, lists and dicts, formatted as
    ruff-format would (flat if it fits, else exploded one item per line)."""
    flat = _flat(obj)
    if indent + prefix + len(flat) + suffix <= WIDTH or not isinstance(obj, tuple | list | dict):
        return flat
    pad = " " * (indent + 4)
    if isinstance(obj, dict):
        items = [
            f"{pad}{_flat(k)}: {py(v, indent + 4, len(_flat(k)) + 2, 1)}," for k, v in obj.items()
        ]
        return "{\n" + "\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{pad}{py(v, indent + 4, 0, 1)}," for v in obj]
    left, right = ("(", ")") if isinstance(obj, tuple) else ("[", "]")
    return left + "\n" + "\n".join(items) + "\n" + " " * indent + right


def _flat(obj: Any) -> str:
    if isinstance(obj, bool) or obj is None:
        return repr(obj)
    if isinstance(obj, MeshWorld):  # a mesh shape: its axis sizes
        return _flat(obj.shape)
    if isinstance(obj, int):
        return repr(obj)
    if isinstance(obj, Ident):
        if not _IDENT.match(obj):
            raise ValueError(f"refusing to emit {obj!r} as a name")
        return str(obj)
    if isinstance(obj, str):
        if not _SAFE_STR.match(obj):
            raise ValueError(f"refusing to emit {obj!r} as a bare literal")
        return f'"{obj}"'
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{_flat(k)}: {_flat(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, tuple):
        inner = ", ".join(_flat(v) for v in obj)
        return f"({inner},)" if len(obj) == 1 else f"({inner})"
    if isinstance(obj, list):
        return "[" + ", ".join(_flat(v) for v in obj) + "]"
    raise TypeError(f"cannot emit a {type(obj).__name__}")


def _tuple(value: Any) -> tuple:
    """Lists (of lists) as tuples, for literals that must be hashable and immutable."""
    if isinstance(value, list | tuple):
        return tuple(_tuple(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuple(v) for k, v in value.items()}  # type: ignore[return-value]
    return value


def docstring(text: str | None, indent: int = 0, width: int = 88) -> str:
    """Free text as the body of a triple-quoted docstring: escaped, wrapped, indented."""
    if not text:
        return ""
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    text = "".join(c if c == "\n" or c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip())]
    pad = " " * indent
    wrapped = [textwrap.fill(p, width - indent, break_on_hyphens=False) for p in paragraphs if p]
    return ("\n\n").join("\n".join(pad + line for line in w.splitlines()) for w in wrapped)


def comment(text: str) -> str:
    """A one-line comment body: printable ASCII only, no newline can escape it."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)


def comment_block(text: str, first: str = "#   ", rest: str = "#     ") -> str:
    """A comment wrapped at the line width, every line printable ASCII."""
    lines = textwrap.wrap(comment(text), WIDTH - len(rest), break_on_hyphens=False)
    return "\n".join((first if i == 0 else rest) + line for i, line in enumerate(lines))


def world_range(worlds: list[int]) -> str:
    if worlds and worlds == list(range(worlds[0], worlds[-1] + 1)) and len(worlds) > 2:
        return f"{worlds[0]}..{worlds[-1]}"
    return ", ".join(str(w) for w in worlds) or "(none)"


def _expr(step: StepPlan, plan: Plan, role: str) -> str:
    """Python expression for the local tensor playing ``role`` in a method body."""
    name = step.roles[role]
    if plan.buffer(name).kind == "engine":
        return name
    return f'self._local["{name}"][slot]'


def _view(step: StepPlan, plan: Plan, role: str) -> str:
    """Python expression for the run-time shaped view of ``role``'s buffer."""
    name = step.roles[role]
    if plan.buffer(name).kind == "engine":
        return name
    return f'self._view("{name}", slot, _env)'


def engine_layouts(step: StepPlan, plan: Plan) -> list[tuple[str, str, int, int, bool]]:
    """(role, engine buffer, a, b, unit) of the step's strided engine inputs, in role
    order: the generated class's LAYOUTS, and what ``_st[k]`` holds in its method."""
    return [
        (role, step.roles[role], a, b, unit)
        for role, (a, b, unit) in step.layouts.items()
        if plan.buffer(step.roles[role]).kind == "engine"
    ]


def _strides(step: StepPlan, plan: Plan, role: str) -> str:
    """The three stride arguments of ``role`` in a launch: the tensor's own (engine
    buffers, checked by the method's Signature) or the packed ones (scalars)."""
    roles = [r for r, *_ in engine_layouts(step, plan)]
    if role in roles:
        return f"*_st[{roles.index(role)}]"
    return ",\n".join(f"_{role}_s{i}" for i in range(3))  # one a line (indent them)


DEVICE_LIBRARY = "dcpc.runtime.device"  # the @triton.jit helpers generated kernels call


DEVICE_PATH = Path(__file__).resolve().parents[1] / "runtime" / "device.py"
_DEVICE_IMPORT = re.compile(r"^from dcpc\.runtime\.device import (\([^)]*\)|[^\n]*)\n", re.M)


@lru_cache(maxsize=1)
def device_names() -> frozenset[str]:
    """The names dcpc/runtime/device.py defines at its top level (its functions and
    constants), read from its source with ``ast``: the compiler never imports triton."""
    import ast

    tree = ast.parse(DEVICE_PATH.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(n for n in names if n.startswith(("_dcpc_", "DCPC_")))


def device_imports(kernels: str) -> str:
    """The import of every device-library name the kernels' text uses, sorted, in
    ruff-format style (one line when it fits, else one name a line)."""
    used = sorted(n for n in set(re.findall(r"\b(?:_dcpc|DCPC)_\w+", kernels))
                  if n in device_names())
    if not used:
        return ""
    line = f"from {DEVICE_LIBRARY} import {', '.join(used)}"
    if len(line) <= WIDTH:
        return line
    return f"from {DEVICE_LIBRARY} import (\n" + "".join(f"    {n},\n" for n in used) + ")"


def torch_bodies(plan: Plan) -> str:
    """The ops' own torch bodies (``OpDef.torch``, after the functions they call:
    ``OpDef.torch_uses``) that the plan's steps call (``OpDef.torch_called``, decided
    from the plan), each once, in step order, as the
    module-level functions their templates' ``torch_body`` macros call
    (``OpDef.torch_name``); "" when none is called (a form of the op that a collective
    of the runtime serves writes no dead body)."""
    return "\n\n\n".join(torch_source(fn, name) for fn, name, _ in _torch_functions(plan))


def _torch_functions(plan: Plan) -> list[tuple[Any, str, str]]:
    """(function, its name in the module, its op) of what ``torch_bodies`` copies: the
    functions the bodies call (OpDef.torch_uses) first, then the bodies."""
    OPS = _ops()  # noqa: N806  (the registry, imported when a module is emitted)
    used = dict.fromkeys(s.op for s in plan.steps if s.op in OPS and OPS[s.op].torch_called(s))
    functions = [(fn, f"_{kind}_{fn.__name__}", kind)
                 for kind in used for fn in OPS[kind].torch_uses]
    return functions + [(OPS[kind].torch, OPS[kind].torch_name, kind) for kind in used]


def check_torch_names(text: str, plan: Plan) -> None:
    """Every global name an op's copied torch function uses (``torch_bodies``) is one the
    emitted module ``text`` defines (an import, a function, a class, a constant) or a
    builtin: a body that calls a helper of its op module (not listed in
    ``OpDef.torch_uses``) is refused here, naming the op and the name, not found when
    the torch backend first runs it (NameError)."""
    import ast
    import builtins
    import symtable

    functions = {name: kind for _, name, kind in _torch_functions(plan)}
    if not functions:
        return
    tree = ast.parse(text)
    defined = set(dir(builtins))
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t)
                           if isinstance(n, ast.Name))
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name in functions):
            continue
        table = symtable.symtable(ast.get_source_segment(text, node) or "", node.name,
                                  "exec")
        missing = sorted(_free_globals(table.get_children()[0]) - defined)
        if missing:
            raise ValueError(
                f"op '{functions[node.name]}': its torch function {node.name} (copied "
                f"into the module) uses '{missing[0]}', which the emitted module does not "
                "define; a function of the op module that the body calls is listed in "
                "its OpDef.torch_uses (then copied, and called by the name "
                f"'_{functions[node.name]}_<function>'), a module it needs is imported "
                "in the body")


def _free_globals(table: Any) -> set[str]:
    """The global names a function's symbol table (and the scopes inside it) use."""
    out = {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
    for child in table.get_children():
        out |= _free_globals(child)
    return out


def _ops() -> dict[str, Any]:
    """The op registry (dcpc.ops), imported when a module is emitted, not with emit."""
    from dcpc.ops import OPS

    return OPS


def torch_source(fn: Any, name: str) -> str:
    """``fn``'s source as the generated module's function ``name``: a plain ``def`` (no
    decorator), its signature without annotations (they name compiler types the module
    does not import), its body as written."""
    import ast
    import inspect

    source = textwrap.dedent(inspect.getsource(fn))
    (node,) = ast.parse(source).body
    if not isinstance(node, ast.FunctionDef) or node.decorator_list:
        raise ValueError(f"{name}: an op's torch body is a plain def, not {source[:40]!r}")
    params = _params(node.args, source)
    head = f"def {name}({', '.join(params)}):"
    if len(head) > WIDTH:  # ruff-format style: one parameter a line
        head = f"def {name}(\n" + "".join(f"    {p},\n" for p in params) + "):"
    body = source.splitlines(keepends=True)[node.body[0].lineno - 1:node.end_lineno]
    if node.body[0].lineno == node.lineno:
        raise ValueError(f"{name}: an op's torch body starts on the line after its def")
    return head + "\n" + "".join(body).rstrip("\n")


def _params(args: Any, source: str) -> list[str]:
    """A def's parameters (an ``ast.arguments`` of ``source``) as written (a default's
    own text), without annotations."""
    import ast

    def one(arg: ast.arg, default: ast.expr | None) -> str:
        if default is None:
            return arg.arg
        return f"{arg.arg}={ast.get_source_segment(source, default)}"

    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [one(a, d) for a, d in zip(positional, defaults, strict=True)]
    if args.posonlyargs:
        out.insert(len(args.posonlyargs), "/")
    if args.vararg is not None:
        out.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        out.append("*")
    out += [one(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg is not None:
        out.append(f"**{args.kwarg.arg}")
    return out


def unpack(names: Any, value: str, indent: int) -> str:
    """``a, b, c = value`` at ``indent`` in ruff-format style: one line when it fits, else
    the names one a line in parentheses."""
    names = list(names)
    pad = " " * indent
    line = f"{pad}{', '.join(names)} = {value}"
    if len(line) <= WIDTH:
        return line
    return f"{pad}(\n" + "".join(f"{pad}    {n},\n" for n in names) + f"{pad}) = {value}"


def inline_device(text: str) -> str:
    """``text`` (an emitted module) with the device library's code in place of its
    import: a self-contained module, whose copy of the signal/wait helpers a mutation
    test can edit (dcpc.harness.run.compile_to's ``patch``)."""
    library = DEVICE_PATH.read_text(encoding="utf-8")
    body = library[library.index("\nfrom dcpc.") + 1:]  # its own imports of dcpc on
    return _DEVICE_IMPORT.sub(lambda _: "\n" + body + "\n\n", text, count=1)


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters.update(
        py=py,
        comment_block=comment_block,
        world_range=world_range,
        docstring=docstring,
        comment=comment,
        tl_dtype=lambda d: TL_DTYPES[d],
        repr=repr,
        tuple=_tuple,
        idents=lambda names: tuple(Ident(n) for n in names),  # a tuple of variables
        local=lambda name: f"_{name}",  # a local of a generated method (see lower.py)
        chomp=lambda text: text[:-1] if text.endswith("\n") else text,
        device_imports=device_imports,
        unpack=unpack,
    )
    return env


def emit(plan: Plan) -> str:
    """Render the module for ``plan``; the same plan gives byte-identical text."""
    for step in plan.steps:  # `dcpc check` refuses these first (unmatched-wait)
        if step.sync.wait is not None and step.sync.polls is None:
            raise ValueError(f"step '{step.name}' waits, but no signal step is matched to it")
    env = _env()

    args: dict[str, Any] = dict(
        local=lambda step, role: _expr(step, plan, role),
        view=lambda step, role: _view(step, plan, role),
        strides=lambda step, role: _strides(step, plan, role),
        engine_layouts=lambda step: engine_layouts(step, plan),
        layouts_const=lambda step: tuple(
            (buf, a, b, unit) for _, buf, a, b, unit in engine_layouts(step, plan)
        ),
        dtype_of=lambda step, role: plan.buffer(step.roles[role]).dtype,
        # a team op (dcpc.lang.mesh) reaches its team's instances, group and size only
        peers=lambda step, name: (f'self._peers["{name}"][slot]' if step.sync.axes is None
                                  else f'self._team_peers("{step.name}", "{name}", slot)'),
        group=lambda step: ("self.group" if step.sync.axes is None
                            else f'self._team_comm("{step.name}", slot)'),
        team_world=lambda step: ("self.world" if step.sync.axes is None
                                 else f'self._team_size("{step.name}")'),
        member=lambda step: ("self.rank" if step.sync.axes is None
                             else f'self._team_member("{step.name}")'),
        torch_called=lambda step: _ops()[step.op].torch_called(step),  # the body's call
    )
    text = _normalize(env.get_template("module.py.j2").render(
        plan=plan, torch_bodies=torch_bodies(plan), **args))
    check_torch_names(text, plan)
    return text


def _normalize(text: str) -> str:
    lines = [line.rstrip() for line in text.splitlines()]
    out: list[str] = []
    for line in lines:
        if not line and out and not out[-1] and len(out) > 1 and not out[-2]:
            continue  # at most two blank lines in a row
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def emit_worlds(plans: list[Plan], checked: list[int] | None = None) -> str:
    """One module serving several W, from the plans of a file whose loops name W (one
    plan per W, each checked on its own): every W's class as ``emit`` writes it, renamed
    ``_<Class>_W<W>``, and the class of the schedule's name, whose ``LOOP_WORLDS`` maps
    each W to its class (dcpc.runtime.module: construction picks the group's). A kernel
    whose text is the same in every W that has it is written once; one whose text
    differs (a step index after the loop shifts with W) is written per W as
    ``<kernel>_w<W>``, and that W's class calls it by that name. ``checked``: every W
    (or mesh shape) checked, when several shapes of one W share its plan."""
    import ast

    if len({p.loop_world for p in plans}) != len(plans) or not all(
            isinstance(p.loop_world, int) for p in plans):
        raise ValueError("emit_worlds takes one plan per W of a loop that names W")
    pieces = [_module_pieces(emit(p)) for p in plans]
    first_plan, (header, prelude, _, _) = plans[0], pieces[0]
    texts: dict[str, dict[int, str]] = {}  # kernel -> W -> its text, in first-seen order
    for plan, (_, _, kernels, _) in zip(plans, pieces, strict=True):
        for name, text in kernels.items():
            texts.setdefault(name, {})[plan.loop_world] = text  # type: ignore[index]
    out_kernels: list[str] = []
    renamed: dict[int, dict[str, str]] = {p.loop_world: {} for p in plans}  # type: ignore[misc]
    for name, by_world in texts.items():
        if len(set(by_world.values())) == 1:
            out_kernels.append(next(iter(by_world.values())))
            continue
        for world, text in by_world.items():
            renamed[world][name] = f"{name}_w{world}"
            out_kernels.append(_rename(text, {name: f"{name}_w{world}"}))
    bodies: dict[int, str] = {}
    for plan, (_, _, _, cls) in zip(plans, pieces, strict=True):
        head = f"class {plan.class_name}(_rt.ScheduleModule):\n"
        if not cls.startswith(head):
            raise ValueError(f"the emitted class does not start with {head!r}")
        bodies[plan.loop_world] = _rename(cls[len(head):], renamed[plan.loop_world])  # type: ignore[index]
    classes, variants = _share_methods(first_plan.class_name, bodies)
    worlds = checked or [w for p in plans for w in p.worlds]
    kernels = "\n\n".join(out_kernels)
    dispatcher = _env().get_template("module_worlds.py.j2").render(
        plan=first_plan, name=first_plan.class_name, worlds=worlds, variants=variants)
    text = _normalize(
        _worlds_header(header, plans, worlds) + "\n" + prelude
        + device_imports(kernels) + "\n\n\n" + kernels + "\n\n\n"
        + "\n\n".join(classes) + dispatcher)
    top = [n.name for n in ast.parse(text).body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    if len(top) != len(set(top)):  # a suffixed kernel or a class named like another
        raise ValueError(f"a module of several W defines a name twice: {sorted(top)}")
    return text


def _share_methods(name: str, bodies: dict[int, str]) -> tuple[list[str], list[tuple[int, str]]]:
    """The classes of a module of several W from each W's class body: a method whose
    text is the same in several W (a hop's, a step's before the loop) is written once,
    in a base class of exactly those W's classes (``_<Class>_Shared_W3to8``); each W's
    class keeps its tables and its own methods. (classes' text, (W, its class name))."""
    import ast

    methods: dict[int, dict[str, str]] = {}
    heads: dict[int, str] = {}
    for world, body in bodies.items():
        lines = body.splitlines(keepends=True)
        nodes = [n for n in ast.parse(textwrap.dedent(body)).body if isinstance(n, ast.FunctionDef)]
        starts = [min([d.lineno for d in n.decorator_list] + [n.lineno]) for n in nodes]
        heads[world] = "".join(lines[:starts[0] - 1] if nodes else lines)
        methods[world] = {n.name: "".join(lines[s - 1:n.end_lineno])
                          for n, s in zip(nodes, starts, strict=True)}
    where: dict[tuple[str, str], list[int]] = {}  # (method, text) -> the W that have it
    for world, table in methods.items():
        for method, text in table.items():
            where.setdefault((method, text), []).append(world)
    shared: dict[tuple[int, ...], list[str]] = {}  # W -> the methods only they share
    for (_, text), worlds in where.items():
        if len(worlds) > 1:
            shared.setdefault(tuple(worlds), []).append(text)
    bases = {worlds: f"_{name}_Shared_W{_worlds_tag(worlds)}" for worlds in shared}
    classes = [f"class {bases[worlds]}:\n" + "\n".join(texts).rstrip("\n") + "\n"
               for worlds, texts in shared.items()]
    variants = []
    for world, table in methods.items():
        variant = f"_{name}_W{world}"
        own = [text for method, text in table.items() if where[(method, text)] == [world]]
        parents = [bases[w] for w in shared if world in w] + ["_rt.ScheduleModule"]
        classes.append(_class_head(variant, parents) + heads[world] + "\n".join(own))
        variants.append((world, variant))
    return classes, variants


def _class_head(name: str, parents: list[str]) -> str:
    """``class name(parents):`` in ruff-format style: one line when it fits, else the
    parents on one line of their own, else one a line."""
    line = f"class {name}({', '.join(parents)}):\n"
    if len(line) <= WIDTH + 1:
        return line
    inner = f"    {', '.join(parents)}"
    if len(inner) <= WIDTH:
        return f"class {name}(\n{inner}\n):\n"
    return f"class {name}(\n" + "".join(f"    {p},\n" for p in parents) + "):\n"


def _worlds_tag(worlds: tuple[int, ...]) -> str:
    """``3to8`` for W 3..8, ``2_4`` for W 2 and 4: a part of a class name."""
    if len(worlds) > 2 and list(worlds) == list(range(worlds[0], worlds[-1] + 1)):
        return f"{worlds[0]}to{worlds[-1]}"
    return "_".join(map(str, worlds))


def _rename(text: str, names: dict[str, str]) -> str:
    """``text`` with each whole-word name of ``names`` replaced (kernels are ``_x_kernel``)."""
    for old, new in names.items():
        text = re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, text)
    return text


def _module_pieces(text: str) -> tuple[str, str, dict[str, str], str]:
    """An emitted module as (its header comments, its imports without the device
    library's, its kernels by name, its class), cut at the statements ``ast`` finds."""
    import ast

    lines = text.splitlines(keepends=True)
    body = ast.parse(text).body

    def span(node: ast.stmt) -> str:
        first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        return "".join(lines[first - 1:node.end_lineno])

    future = next(n for n in body if isinstance(n, ast.ImportFrom) and n.module == "__future__")
    funcs = [n for n in body if isinstance(n, ast.FunctionDef)]
    (cls,) = [n for n in body if isinstance(n, ast.ClassDef)]
    end = (min((d.lineno for d in funcs[0].decorator_list), default=funcs[0].lineno)
           if funcs else cls.lineno) - 1
    prelude = _DEVICE_IMPORT.sub("", "".join(lines[future.lineno - 1:end])).rstrip("\n") + "\n"
    header = "".join(lines[:future.lineno - 1])
    return header, prelude, {f.name: span(f) for f in funcs}, span(cls)


def _worlds_header(header: str, plans: list[Plan], worlds: list[int]) -> str:
    """The first W's header comments with the W checked, then each W's call-order
    contract under the class that keeps it."""
    lines = header.rstrip("\n").split("\n")
    checked = next(i for i, line in enumerate(lines) if line.startswith("# checked for W in"))
    out = lines[:checked]
    out.append(comment_block(f"checked for W in {world_range(worlds)}, one class per W",
                             "# ", "#   "))
    out.append("# call-order contract (every rank keeps it; see docs/internals.md), per W:")
    for plan in plans:
        out.append(f"# at W={plan.loop_world} (class _{plan.class_name}_W{plan.loop_world}):")
        out += [comment_block(line) for line in plan.contract]
    return "\n".join(out) + "\n"
