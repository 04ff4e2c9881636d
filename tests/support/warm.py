"""A launcher worker (tests/run/test_host_launch.py): what a rank finds already done
when it starts, before it imports anything itself."""

from __future__ import annotations

import sys


def state(rank: int, world: int) -> dict[str, object]:
    del rank, world
    lower = sys.modules.get("dcpc.codegen.lower")
    return {"forkwarm": "dcpc.harness.forkwarm" in sys.modules,
            "imported": sorted(m for m in ("dcpc.codegen.lower", "dcpc.runtime.host",
                                           "dcpc.runtime.loading",
                                           "triton.compiler.code_generator",
                                           "torch.utils.serialization")
                               if m in sys.modules),
            "base_class_names": None if lower is None
            else lower.base_class_names.cache_info().currsize}
