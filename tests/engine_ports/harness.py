"""What the ported engine tests share: one child process per rank runs every case of a
ported file (the ``torch`` backend over gloo), or one thread per rank (a dcpc LocalGroup,
the ``local`` backend: the generated Triton kernels under the interpreter, as the
``host`` backend runs them, in one process). ``LocalRuns`` starts several LocalGroup runs
side by side, each in a process forked from dcpc.harness.launch's fork server (the
interpreter holds the GIL: threads of one process use one core, the runs use two)."""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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


def local_child(rank: int, world: int, module: str, function: str, ranks: int) -> list[Any]:
    """A fork-server child, alone in its gloo group (``world`` 1): ``module.function(
    rank, r, ranks, barrier)`` on a LocalGroup of ``ranks`` threads; every rank's result."""
    from dcpc.runtime.local import LocalGroup

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    fn = getattr(importlib.import_module(module), function)
    g = LocalGroup(ranks, "cpu", timeout_s=300)
    return g.run(lambda rank: fn(rank, rank.rank, ranks, rank.barrier))


class LocalRuns:
    """LocalGroup runs started now, side by side in fork-server children (the
    environment: the launcher's, with ``env`` over it); ``result(key)`` waits for one."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {})}
        self.pool = ThreadPoolExecutor(max_workers=4)
        self.futures: dict[Any, Future] = {}

    def start(self, key: Any, module: str, function: str, ranks: int) -> None:
        from dcpc.harness.launch import launch

        self.futures[key] = self.pool.submit(
            launch, "engine_ports.harness:local_child", 1,
            {"module": module, "function": function, "ranks": ranks},
            timeout_s=600, env=self.env)

    def result(self, key: Any) -> list[Any]:
        got = self.futures[key].result()
        assert got.ok, got.summary() + "".join(o.traceback for o in got.outcomes)
        return got.values()[0]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _selected(request: pytest.FixtureRequest) -> set[tuple[str, Any]]:
    """(test name, its ``world`` or None) of this session's selected tests of this module."""
    return {(item.originalname, item.callspec.params.get("world")
             if hasattr(item, "callspec") else None)
            for item in request.session.items if item.module is request.module}


@pytest.fixture(scope="module")
def local_runs(request: pytest.FixtureRequest, port_cache_dir: str) -> Iterator[LocalRuns]:
    """A module's LocalRuns over the session's port cache: the module lists them as
    ``LOCAL_RUNS = [(test name, world, module, function), ...]``; those whose test runs
    in this session start at once (key: (module, function, world))."""
    runs = LocalRuns({"DCPC_CACHE_DIR": port_cache_dir})
    wanted = _selected(request)
    try:
        for test, world, module, function in request.module.LOCAL_RUNS:
            if (test, world) in wanted:
                runs.start((module, function, world), module, function, world)
        yield runs
    finally:
        runs.close()
