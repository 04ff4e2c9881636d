"""A launcher worker (tests/run/test_host_launch.py): what a rank finds already done
when it starts, before it imports anything itself."""

from __future__ import annotations

import sys


def state(rank: int, world: int) -> dict[str, object]:
    del rank, world
    lower = sys.modules.get("dcpc.codegen.lower")
    device = sys.modules.get("dcpc.runtime.device")
    interpreter = sys.modules.get("triton.runtime.interpreter")
    jit = [] if device is None or interpreter is None else [
        f for f in vars(device).values() if isinstance(f, interpreter.InterpretedFunction)]
    return {"forkwarm": "dcpc.harness.forkwarm" in sys.modules,
            # the device library's jit functions, and how many are rewritten already
            "device_rewrites": (len(jit), sum(f.fn in interpreter.InterpretedFunction
                                              .rewritten_fn for f in jit) if jit else 0),
            "imported": sorted(m for m in ("dcpc.codegen.lower", "dcpc.runtime.host",
                                           "dcpc.runtime.loading",
                                           "triton.compiler.code_generator",
                                           "torch.utils.serialization")
                               if m in sys.modules),
            "base_class_names": None if lower is None
            else lower.base_class_names.cache_info().currsize}
