"""A wait reads its peers' failure flags before their signal cells (CPU backends).

A peer raises its flag (closed, failed) after its signals; a wait that polled a peer's
cell, was descheduled, and then read the flags saw the signal pending and the flag up:
"peer 1 was closed before it made this call" for a peer that had signalled and closed
meanwhile (seen as tests/ops/test_cast.py's all_to_all child failing on a loaded
machine). Here the interleaving is forced: rank 0's first poll inside its spin holds
until rank 1 has made the call and closed (a timing shim on the interpreter's atomic
add of nothing: no value read or written changes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support import child_result
from support.kernels import run_ranks

SCHEDULE = """\
schedule: flag_order
buffers:
  x: {shape: [4], dtype: f32}
steps:
  - fin: {op: barrier}
"""


def _child() -> None:
    import tempfile
    import threading

    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class

    polled, closed = threading.Event(), threading.Event()
    held: dict[str, Any] = {"thread": None, "polls": 0}
    builder = type(interpreter.interpreter_builder)
    original = builder.create_atomic_rmw

    def create_atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, sem: Any,
                          scope: Any) -> Any:
        got = original(self, op, ptr, val, mask, sem, scope)
        if (op == ir.ATOMIC_OP.ADD and not np.any(val.data)
                and threading.get_ident() == held["thread"]):
            held["polls"] += 1
            if held["polls"] == 2:  # the spin's first poll (the first is the wait's look)
                polled.set()
                closed.wait(120)
        return got

    builder.create_atomic_rmw = create_atomic_rmw  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="dcpc-flag-") as tmp:
        path = Path(tmp) / "flag_order.yaml"
        path.write_text(SCHEDULE)
        _, module, _, _ = compile_to(str(path), Path(tmp), 2)

        def rank_main(rank: Any) -> str:
            inst = load_module_class(module, "flag_order")(rank, device="cpu",
                                                          backend="local")
            try:
                if rank.rank == 0:
                    held["thread"] = threading.get_ident()
                    inst.fin()
                else:
                    polled.wait(120)  # rank 0 polled and found this rank's signal pending
                    inst.fin()
                    inst.close()
                    closed.set()
            finally:
                closed.set()
                inst.close()
            return "ok"

        try:
            got = run_ranks(2, rank_main)
            out = {"result": got, "polls": held["polls"]}
        except Exception as exc:  # noqa: BLE001 (the test names what the wait said)
            out = {"error": f"{type(exc).__name__}: {exc}", "polls": held["polls"]}
    print("RESULT " + json.dumps(out))


@pytest.mark.e2e
def test_a_peer_that_signalled_and_closed_during_a_poll_is_no_failure() -> None:
    out = child_result(__file__, "child")
    assert out["polls"] >= 2, out  # the hold happened: rank 0 spun past rank 1's close
    assert out.get("result") == ["ok", "ok"], out


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    _child()
