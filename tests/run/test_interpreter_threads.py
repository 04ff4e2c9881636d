"""The interpreter shim of dcpc.runtime.local under thread races (issue 22, first item).

Triton 3.6's interpreter adds its own names to a kernel module's globals the first time
it rewrites a jit function of that module; another rank's thread patching the language
for a launch iterates the same globals. Without one lock around both, the patch raises
"dictionary changed size during iteration" inside a rank's kernel (24 failed tests of
test_engines_local on a loaded machine).
"""

from __future__ import annotations

import importlib.util
import threading
import types
from pathlib import Path

import pytest

pytest.importorskip("triton")

TRIALS = 30  # the unfixed shim failed 2 of 12 on an idle 2-core machine


def _module_with_kernels(folder: Path, trial: int, padding: int) -> types.ModuleType:
    """A fresh module (a real file: the rewriter reads its source) of two functions
    whose globals hold ``padding`` extra names, so that iterating them takes long enough
    for a rewrite to land inside."""
    path = folder / f"dcpc_race_probe_{trial}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n"
                    "def kernel0(x):\n    return x\n\n\n"
                    "def kernel1(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__dict__.update({f"pad{i}": i for i in range(padding)})
    return mod


def test_patch_and_first_rewrite_race_no_more(tmp_path: Path) -> None:
    from triton.runtime import interpreter

    from dcpc.runtime import local

    local._install_interpreter_threads()
    errors: list[BaseException] = []
    for trial in range(TRIALS):
        mod = _module_with_kernels(tmp_path, trial, 60_000)
        patched = mod.kernel0
        rewritten = interpreter.InterpretedFunction(mod.kernel1)
        start = threading.Barrier(2)

        def patch(fn: object = patched, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                for _ in range(3):
                    interpreter._patch_lang(fn)
            except BaseException as e:  # noqa: BLE001 (the race's error is the finding)
                errors.append(e)

        def rewrite(fn: interpreter.InterpretedFunction = rewritten,
                    start: threading.Barrier = start) -> None:
            start.wait()
            try:
                fn.rewrite()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=patch), threading.Thread(target=rewrite)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), f"trial {trial}: a thread hangs"
        interpreter.InterpretedFunction.rewritten_fn.pop(mod.kernel1, None)
    assert not errors, f"{len(errors)} of {TRIALS} trials raised: {errors[0]!r}"
