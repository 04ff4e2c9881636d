"""``local`` backend: ranks that construct one module with different sizes raise the
same ``DcpcArgumentError`` as on ``host`` and ``torch`` (dcpc.runtime.rendezvous's
comparison over the LocalGroup's in-process exchange). Before, local skipped the check:
every rank constructed, and calls returned wrong data (or other shapes) silently."""

from __future__ import annotations

from typing import Any

import pytest
from support.kernels import construct_on_local_ranks

from dcpc.engines.common import GatherSpec, module_class
from dcpc.runtime.local import LocalGroup


@pytest.mark.parametrize("world", [2, 3])
def test_local_construction_sizes_differ(world: int) -> None:
    cls = module_class(GatherSpec("q", 16, "bf16", 4), world)
    got = construct_on_local_ranks(
        cls, world, lambda r: {"H": 4 * world if r == 0 else 2 * world}, timeout_s=10)
    others = ", ".join(str(r) for r in range(1, world))
    want = (f"constructed it with different arguments: size H: {4 * world} (rank 0), "
            f"{2 * world} (rank{'s' if world > 2 else ''} {others})")
    for r in range(world):
        assert want in got[r], (r, got)


def test_local_construction_same_sizes_still_construct() -> None:
    cls = module_class(GatherSpec("q", 16, "bf16", 4), 2)
    got: dict[int, str] = {}

    def body(rank: Any) -> None:
        m = cls(rank, sizes={"H": 4}, device="cpu", backend="local", timeout_s=10)
        got[rank.rank] = type(m).__name__
        m.close()

    LocalGroup(2, "cpu", timeout_s=60).run(body, timeout_s=60)
    assert got == {0: cls.__name__, 1: cls.__name__}
