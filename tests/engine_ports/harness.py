"""What the ported engine tests share: one child process per rank runs every case of a
ported file (the ``torch`` backend over gloo), or one thread per rank (a dcpc LocalGroup,
the ``local`` backend: the generated Triton kernels under the interpreter, as the
``host`` backend runs them, in one process)."""

from __future__ import annotations

import importlib
import os
import warnings
from types import SimpleNamespace
from typing import Any

import pytest


class FakeCPGroup(SimpleNamespace):
    """vLLM's own test fixture ``_FakeCPGroup(world_size, device_group)``: what vLLM's
    tests pass as the DCP group."""


def torch_worker(rank: int, world: int, cache: str, modules: list[str],
                 backend: str = "torch") -> dict[str, Any]:
    """Child process ``rank``: every ``module.run_all`` in turn, with the gloo group
    wrapped as vLLM's tests wrap it, on ``backend``; their results by module."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    os.environ.update({"DCPC_CACHE_DIR": cache, "DCPC_BACKEND": backend})
    group = FakeCPGroup(world_size=world, device_group=dist.group.WORLD)
    found = {}
    for module in modules:
        found[module] = importlib.import_module(module).run_all(group, rank, world,
                                                                dist.barrier)
        dist.barrier()
    return found


def local_run(module: str, world: int) -> list[Any]:
    """``module.run_all`` on a LocalGroup of ``world`` threads."""
    from dcpc.runtime.local import LocalGroup

    g = LocalGroup(world, "cpu", timeout_s=300)
    run_all = importlib.import_module(module).run_all
    return g.run(lambda rank: run_all(rank, rank.rank, world, rank.barrier))


@pytest.fixture(scope="session")
def port_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One module cache for every ported test of the session: the local runs compile
    each schedule once, and the torch-backend children (launched last) find them."""
    return str(tmp_path_factory.mktemp("dcpc-port-cache"))


@pytest.fixture(autouse=True)
def port_cache(port_cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCPC_CACHE_DIR is the session's port cache (import both fixtures into a test
    module to use them)."""
    monkeypatch.setenv("DCPC_CACHE_DIR", port_cache_dir)
