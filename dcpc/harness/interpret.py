"""The CPU interpreter, made to run a launch's programs in another order.

Triton's interpreter runs the programs of a launch one after another, program 0 first.
On a GPU they run at once, in any order: a kernel whose result depends on one program
running before another (a program reading what another wrote, a tile written twice by
two programs) passes every CPU run in the natural order. ``program_order`` makes the
interpreter take the programs of every launch in reverse or in a seeded shuffled order
instead; with several programs per launch (``dcpc run --programs``), such a kernel then
fails on CPU too. The order depends only on the seed and the number of programs, so every
rank takes the same one: program i of a rank waits only for program i of its peers
(templates/sync.j2), and ranks that ran their programs in different orders could wait
for each other in a cycle.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any

ORDERS = ("natural", "reverse", "shuffle")
_lock = threading.Lock()
_state: dict[str, Any] = {"order": "natural", "seed": 0, "perms": {}}


def program_order(order: str, seed: int = 0) -> None:
    """From now on, in this process, interpreted launches take their programs in
    ``order`` (one of ORDERS; "shuffle" seeded by ``seed``)."""
    if order not in ORDERS:
        raise ValueError(f"program order {order!r}: choose from {', '.join(ORDERS)}")
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    with _lock:
        _state.update(order=order, seed=seed, perms={})
        if getattr(builder.set_grid_idx, "_dcpc_order", False):
            return
        natural = builder.set_grid_idx

        def set_grid_idx(self: Any, x: int, y: int, z: int) -> None:
            return natural(self, _position(x, self.grid_dim[0]), y, z)

        set_grid_idx._dcpc_order = True  # type: ignore[attr-defined]
        builder.set_grid_idx = set_grid_idx  # type: ignore[method-assign]


def _position(x: int, programs: int) -> int:
    """The program the interpreter's ``x``-th turn runs."""
    order = _state["order"]
    if order == "natural" or programs < 2:
        return x
    if order == "reverse":
        return programs - 1 - x
    perms = _state["perms"]
    perm = perms.get(programs)
    if perm is None:
        perm = list(range(programs))
        random.Random(f"{_state['seed']}/{programs}").shuffle(perm)
        perms[programs] = perm
    return perm[x]


def share_rewrites(module_path: str, store: str) -> None:
    """From now on, in this process, the interpreter's rewrite of a jit function defined
    in ``module_path`` (the generated module a run's ranks all load) is made once per run,
    by the first rank that needs it, and read by the others.

    Triton's interpreter rewrites every jit function before its first call (its source
    found and tokenized, parsed, transformed and compiled: ``FunctionRewriter.rewrite_ast``),
    once per process; the host backend's ranks are W processes running the same module,
    so each made every rewrite again: a tenth of a rank's CPU under ``dcpc run`` (cProfile
    of gallery deepep_normal at 2x3, 156 functions a rank). The compiled code of each is
    kept beside the module (``<module>.rewrites/``, keyed by the module's content, the
    function's name and its first line) under one file lock per module, so that ranks
    reaching a function together make it once; a rank that finds it runs the very code
    the others made (marshal), in its own module's globals, as the original does after
    compiling. Functions of other files (the device library) are rewritten as before.
    ``store``: a folder of the run (``run_rank``'s ``sims_dir``, removed with the run),
    never beside the module (a user's ``--module`` file may sit in a folder the ranks
    cannot write, and must not keep code across runs); an entry is keyed by the module's
    content, Python's bytecode magic and Triton's version too, and a store that cannot be
    written or read back (a full disk, a cut entry) falls back to Triton's own rewrite."""
    from triton.runtime import interpreter

    rewriter = interpreter.FunctionRewriter
    with _lock:
        _state.setdefault("shared", {})[os.path.abspath(module_path)] = store
        if getattr(rewriter.rewrite_ast, "_dcpc_shared", False):
            return
        original = rewriter.rewrite_ast

        def rewrite_ast(self: Any) -> Any:
            path = getattr(getattr(self.fn, "__code__", None), "co_filename", None)
            if path is None or os.path.abspath(path) not in _state["shared"]:
                return original(self)
            try:
                code = _shared_code(self, path, _state["shared"][os.path.abspath(path)])
            except (OSError, ValueError, EOFError, TypeError):  # the store failed: no sharing
                code = None
            if code is None:  # no source to read, or no store: the original's answer
                return original(self)
            namespace = {**self.kwargs}  # what _compile_and_exec does after its compile
            fn_globals = self.fn.__globals__
            for key, value in vars(interpreter).items():
                if key not in fn_globals:
                    fn_globals[key] = value
            exec(code, fn_globals, namespace)
            return namespace[self.fn.__name__]

        rewrite_ast._dcpc_shared = True  # type: ignore[attr-defined]
        rewriter.rewrite_ast = rewrite_ast  # type: ignore[method-assign]


def _shared_code(rewriter: Any, path: str, store: str) -> Any:
    """The compiled rewrite of ``rewriter.fn`` (a function of the module at ``path``): read
    from the run's store, else made as Triton makes it and stored; None when the
    function has no source to read (Triton then runs it as it is)."""
    import fcntl
    import hashlib
    import importlib.util
    import inspect
    import marshal

    import triton

    digests = _state.setdefault("digests", {})
    digest = digests.get(path)
    if digest is None:
        with open(path, "rb") as f:  # the module, the bytecode format, Triton's rules
            digest = digests[path] = hashlib.sha256(
                f.read() + importlib.util.MAGIC_NUMBER + triton.__version__.encode()
            ).hexdigest()[:16]
    os.makedirs(store, exist_ok=True)
    fn = rewriter.fn
    entry = os.path.join(store, f"{digest}.{fn.__qualname__}.{fn.__code__.co_firstlineno}")
    with open(os.path.join(store, "lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when this rank dies
        if os.path.exists(entry):
            with open(entry, "rb") as f:
                return marshal.loads(f.read())
        try:
            lines, _ = inspect.getsourcelines(fn)
        except Exception:  # noqa: BLE001 (Triton's own test: no source, no rewrite)
            return None
        # Triton's rewrite_ast, to its compile (triton/runtime/interpreter.py, 3.6)
        rewriter.filename, rewriter.def_file_lineno = rewriter._get_jit_fn_file_line()
        rewriter.def_lineno = rewriter._find_def(lines)
        tree = rewriter._transform_ast(rewriter._prepare_source(lines))
        code = compile(tree, filename=rewriter.filename, mode="exec")
        made = f"{entry}.{os.getpid()}"
        with open(made, "wb") as f:
            f.write(marshal.dumps(code))
        os.replace(made, entry)
        return code
