"""The vLLM and SGLang adapters across processes (gloo): the ``torch`` backend (gloo
collectives plus dcpc's reference merge) at W = 2 and 3 and the ``host`` backend (the
Triton kernels under the interpreter, peers in shared memory) at W = 2, with the group
passed as a GroupCoordinator-like object (device_group, cpu_group, world_size,
rank_in_group). Same scenarios and float64 reference as test_engines_local.py."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from test_engines_local import CASE_ENV, CASES, WORKSPACE, scenario

from dcpc.harness.launch import launch

pytestmark = pytest.mark.host

def worker(rank: int, world: int, cache: str, backend: str, cases: list[str]
           ) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    os.environ.update({"DCPC_CACHE_DIR": cache, "DCPC_MAX_NUM_TOKENS": str(WORKSPACE),
                       "DCPC_BACKEND": backend})
    pg = dist.group.WORLD
    coordinator = SimpleNamespace(device_group=pg, cpu_group=pg, world_size=world,
                                  rank_in_group=rank)
    out: dict[str, Any] = {}
    for name in cases:
        os.environ.update(CASE_ENV.get(name, {}))
        try:
            out[name] = scenario(name, coordinator, rank, world, dist.barrier, backend)
        finally:
            for k in CASE_ENV.get(name, {}):
                os.environ.pop(k)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One module cache for this file's launches: the first launch's ranks compile
    every schedule (side by side, written atomically), the later ones import them."""
    return str(tmp_path_factory.mktemp("dcpc-engines-"))


# host (W interpreted processes spinning on each other) at W = 3 takes a minute: W = 2
@pytest.mark.parametrize("world, backend", [(2, "torch"), (3, "torch"), (2, "host")])
def test_adapters_across_processes(world: int, backend: str, cache: str) -> None:
    result = launch("test_engines_torch:worker", world,
                    {"cache": cache, "backend": backend, "cases": CASES}, timeout_s=600)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    for r, per_case in enumerate(result.values()):
        assert sorted(per_case) == sorted(CASES)
        for name, checks in per_case.items():
            assert checks, (r, name)
            bad = [c for c in checks if not c["ok"]]
            assert not bad, (backend, r, name, bad)
