"""Per-axis backends (issue 21 item 5): a mesh module's ``backend=`` maps each axis to a
kind, checked at construction (every step's axes on ONE kind; unknown or missing axes;
a kind that needs a process group without one); the symmetric heap spans the symmetric
axes' team only; ``dcpc run --world 2x2 --backend node=torch,gpu=host`` runs the node
steps on gloo and the gpu steps' kernels on host shared memory, against float64."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from dcpc import pipeline
from dcpc.demo import _backend
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.runtime import axes
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.heap import LocalHeap
from dcpc.runtime.loading import import_file, schedule_class

ROOT = Path(__file__).resolve().parent.parent
TWO_LEVEL = ROOT / "tests" / "mesh_backends" / "two_level.yaml"
HIERARCHICAL = ROOT / "schedules" / "gallery" / "hierarchical_two_level.yaml"
MIXED = {"node": "torch", "gpu": "host"}


def _class(tmp: Path, path: Path) -> type:
    c = pipeline.run(path, pipeline.Options(worlds=[MeshWorld((2, 2))]), until="emit")
    module = tmp / f"{path.stem}.py"
    module.write_text(c.module_text)
    return schedule_class(import_file(str(module), f"dcpc_axes_{path.stem}"), path.stem)


@pytest.fixture(scope="module")
def two_level(tmp_path_factory: pytest.TempPathFactory) -> type:
    return _class(tmp_path_factory.mktemp("axes"), TWO_LEVEL)


@pytest.fixture(scope="module")
def hierarchical(tmp_path_factory: pytest.TempPathFactory) -> type:
    return _class(tmp_path_factory.mktemp("axes"), HIERARCHICAL)


ONE = {"N": 1, "G": 1, "H": 4}  # the 1x1 mesh: one rank, no process group


def test_each_step_gets_the_kind_of_its_axes(two_level: type) -> None:
    kind, per_axis, torch_steps = axes.split(
        "M", MIXED, two_level.MESH, two_level.TEAMS, two_level.SIGNALLING)
    assert (kind, per_axis) == ("host", MIXED)
    assert torch_steps == {"gather_nodes": (0,), "sum_nodes": (0,)}
    module = two_level(None, sizes=ONE, device="cpu", backend=MIXED)
    try:
        assert module.backend == "host" and module.backends == MIXED
        assert module._on_torch == {"gather_nodes", "sum_nodes"}
        assert not module._fast  # a torch body is never replayed as a call plan
    finally:
        module.close()


def test_one_kind_for_every_axis_is_that_plain_kind(two_level: type) -> None:
    assert axes.split("M", {"node": "host", "gpu": "host"}, two_level.MESH,
                      two_level.TEAMS, two_level.SIGNALLING) == ("host", MIXED.fromkeys(
                          MIXED, "host"), {})
    assert axes.split("M", "torch", two_level.MESH, {}, ()) == ("torch", {}, {})


def test_a_step_over_axes_of_different_kinds_is_refused(hierarchical: type) -> None:
    # out_exchange is an all_to_all over every axis: node (torch) and gpu (host)
    with pytest.raises(DcpcArgumentError, match=(
            r"step 'out_exchange' runs over axes node, gpu, which backend= serves by "
            r"different kinds \(node: torch, gpu: host\)")):
        hierarchical(None, sizes={"N": 1, "G": 1, "H": 2}, device="cpu", backend=MIXED)


@pytest.mark.parametrize("backend,words", [
    ({"node": "torch", "gpu": "host", "rack": "torch"}, "names axis 'rack', which the mesh"),
    ({"node": "torch"}, "gives no kind to axis 'gpu'"),
    ({"node": "nccl", "gpu": "host"}, "gives axis 'node' the kind 'nccl'"),
    ({"node": "torch", "gpu": "local"}, "'local' runs every rank as a thread"),
    ({"node": "symm_mem", "gpu": "host"}, "one symmetric kind per mesh"),
])
def test_bad_mappings_are_refused(two_level: type, backend: dict, words: str) -> None:
    with pytest.raises(DcpcArgumentError, match=words):
        two_level(None, sizes=ONE, device="cpu", backend=backend)


def test_a_mapping_needs_a_mesh() -> None:
    with pytest.raises(DcpcArgumentError, match="needs a schedule with mesh"):
        axes.split("M", {"x": "host"}, (), {}, ())


def test_a_kind_that_needs_a_group_without_one_is_refused(two_level: type) -> None:
    with pytest.raises(DcpcArgumentError, match=(
            r"axis 'node' runs on torch, which needs this rank's process group along it: "
            r"groups= has none for 'node'")):
        two_level(None, sizes=ONE, device="cpu", backend=MIXED, groups={"gpu": object()})
    with pytest.raises(DcpcArgumentError, match="groups= names axis 'rack'"):
        two_level(None, sizes=ONE, device="cpu", backend=MIXED, groups={"rack": object()})


def test_the_heap_of_a_team_is_indexed_by_module_rank() -> None:
    """A team's heap (here one rank of a 2-rank team) widened to the module's 4 ranks:
    its members' addresses at their module ranks, 0 for ranks outside the team."""
    inner = LocalHeap(rank=1, world=2, device=torch.device("cpu"))
    heap = axes.TeamHeap(inner, members=[1, 3], rank=3, world=4)
    seg, other = heap.allocate([64, 128])
    assert seg.peer_ptrs.tolist() == [0, 0, 0, seg.local.data_ptr()]
    assert other.peer_ptrs.tolist() == [0, 0, 0, other.local.data_ptr()]
    heap.close()


def test_cli_backend_syntax() -> None:
    assert _backend("host") == "host"
    assert _backend("node=torch,gpu=host") == MIXED
    for bad, words in (("node=torch,node=host", "named twice"), ("node=nccl", "'nccl'"),
                       ("node", "invalid kind"), ("node=local,gpu=host", "local runs")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            _backend(bad)


@pytest.mark.e2e
def test_dcpc_run_2x2_node_on_torch_gpu_on_host() -> None:
    """4 processes: gloo groups for the node teams, host shared memory per gpu team;
    every output of both kinds of step matches float64 (each step reads what a step of
    the other kind wrote)."""
    report = run_schedule(RunConfig(schedule=str(TWO_LEVEL), world=MeshWorld((2, 2)),
                                    backend=dict(MIXED), calls=3, seed=5))
    out = format_report(report)
    assert report.ok, out
    assert "backend node=torch,gpu=host" in out
    for name in ("q_node", "q_full", "part_node", "part_shard"):
        assert report.outputs[name].compared == 3 * 4 and not report.outputs[name].mismatches


def test_a_torch_step_of_a_mixed_module_settles_its_team(two_level: type) -> None:
    """The node steps run their torch body and then meet their team (docs/hb-checker.md,
    "Per-axis backends"); the gpu steps run their kernels and never do (1x1 mesh)."""
    module = two_level(None, sizes=ONE, device="cpu", backend=MIXED)
    settled: list[str] = []
    real = module._settle
    module._settle = lambda step, slot: (settled.append(step), real(step, slot))
    try:
        q = torch.randn(2, 4, 8).to(torch.bfloat16)
        part = torch.randn(2, 4, 8)
        assert torch.equal(module.gather_in_node(q), q)
        assert torch.equal(module.gather_nodes(), q)
        assert torch.equal(module.sum_nodes(part), part)
        assert torch.equal(module.sum_in_node(), part)
        assert settled == ["gather_nodes", "sum_nodes"]
    finally:
        module.close()
