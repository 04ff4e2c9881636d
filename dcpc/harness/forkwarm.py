"""Imported once by the fork server ``dcpc.harness.launch`` starts its ranks from
(``PRELOAD``), never by a rank itself: what every host-backend rank of every run
would otherwise do again in a fresh process before its first call, done once, inherited
by each forked rank.

Measured per rank (sys.modules and cProfile of run_rank, schedules/ops/all_gather.yaml
at W=3): the imports of the lowering (``worker.returned_names``), the host backend, the
loader of the generated module, Triton's code generator (the interpreter's rewrite of
jit functions) and torch.save's serialization (the shared float64 simulations), 0.1 to
0.2 s of CPU; and ``lower.base_class_names`` (the runtime's module.py parsed and walked
with ``ast``: lru-cached, so once per process), 0.2 s. A run of W ranks paid both W
times; the fork server pays them once per test process. Also the interpreter's rewrite
of every jit function of the device library (dcpc.runtime.device, which every generated
module calls; Triton keeps each rewrite per process, ``InterpretedFunction.rewritten_fn``):
0.1 s of CPU per rank, made once here (the generated module's own functions are shared
between the ranks of a run instead: dcpc.harness.interpret.share_rewrites).
"""

from __future__ import annotations

import torch.utils.serialization  # noqa: F401
import triton.compiler.code_generator  # noqa: F401

import dcpc.harness.worker  # noqa: F401
import dcpc.runtime.host  # noqa: F401
import dcpc.runtime.loading  # noqa: F401
from dcpc.codegen.lower import base_class_names

# the fork server survives only an ImportError of a preload: anything else here would
# end it, and every later run of this process with an EOFError naming nothing; a rank
# that finds the cache empty computes it itself and reports its own error, located
try:
    base_class_names()
except Exception:  # noqa: BLE001 (a warm-up: the rank does the real work)
    pass
try:  # the fork server runs Triton's interpreter (TRITON_INTERPRET=1, launch._context)
    from triton.runtime.interpreter import InterpretedFunction

    import dcpc.runtime.device

    # a list first: each rewrite adds the interpreter's names to the module's globals
    for _fn in [f for f in vars(dcpc.runtime.device).values()
                if isinstance(f, InterpretedFunction)]:
        _fn.rewrite()
except Exception:  # noqa: BLE001 (a warm-up: a rank rewrites what is missing itself)
    pass
