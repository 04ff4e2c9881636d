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
