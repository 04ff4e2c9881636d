"""Per-axis backends (issue 21 item 5): a mesh module's ``backend=`` maps each axis to a
kind, checked at construction (every step's axes on ONE kind; unknown or missing axes;
a kind that needs a process group without one); the symmetric heap spans the symmetric
axes' team only; ``dcpc run --world 2x2 --backend node=torch,gpu=host`` runs the node
steps on gloo and the gpu steps' kernels on host shared memory, against float64."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpc import pipeline
from dcpc.demo import _backend
from dcpc.harness.launch import launch
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.runtime import axes
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.heap import LocalHeap
from dcpc.runtime.loading import import_file, schedule_class

ROOT = Path(__file__).resolve().parents[2]
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
    with pytest.raises(DcpcArgumentError, match="groups= goes with backend= as a mapping"):
        two_level(None, sizes=ONE, device="cpu", backend="host", groups={"gpu": object()})


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


@pytest.mark.e2e
@pytest.mark.parametrize("stem, backend", [
    ("double_ring", {"outer": "torch", "inner": "host"}),
    ("usp", {"ring": "torch", "uly": "host"}),
    ("usp", {"ring": "host", "uly": "torch"}),
    ("deepep_normal", {"node": "torch", "gpu": "host"}),
], ids=["double_ring-outer_torch", "usp-ring_torch", "usp-uly_torch", "deepep-node_torch"])
def test_gallery_layouts_of_one_axis_steps_run_mixed(stem: str, backend: dict) -> None:
    """The gallery's double ring, USP and DeepEP normal mode run every step over one mesh
    axis (or none), so each axis may run on its own kind: every output still matches
    float64 at 2x2 (DeepEP's rail on gloo, its NVLink hops on host shared memory)."""
    report = run_schedule(RunConfig(schedule=str(ROOT / "schedules" / "gallery" / f"{stem}.yaml"),
                                    world=MeshWorld((2, 2)), backend=backend, calls=3, seed=7))
    out = format_report(report)
    assert report.ok and report.mismatches == 0, out
    assert "backend " + ",".join(f"{a}={k}" for a, k in backend.items()) in out, out


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


def engine_worker(rank: int, world: int, module_path: str, calls: int) -> dict[str, Any]:
    """An engine's view: it makes its own process groups per axis (every rank, the same
    order), passes them as ``groups=`` with ``backend={"node": "torch", "gpu": "host"}``,
    and checks each returned output against float64 from every rank's inputs."""
    import torch.distributed as dist

    n, g, t, h, d = 2, 2, 3, 8, 8
    node_of, gpu_of = divmod(rank, g)
    groups = {}
    for gpu in range(g):  # node teams: same gpu index, every node
        pg = dist.new_group([node * g + gpu for node in range(n)])
        if gpu == gpu_of:
            groups["node"] = pg
    for node in range(n):  # gpu teams: one node's ranks
        pg = dist.new_group([node * g + gpu for gpu in range(g)])
        if node == node_of:
            groups["gpu"] = pg
    cls = schedule_class(import_file(module_path, "dcpc_axes_engine"), "two_level")
    module = cls(dist.group.WORLD, sizes={"N": n, "G": g, "H": h}, device="cpu",
                 backend=dict(MIXED), groups=groups, poison=True)
    heap = module._heap
    out = {"heap_world": heap.inner.world, "own_group": heap.inner.group is groups["gpu"],
           "team_ptrs": [int(p != 0) for p in module._peers["q_node"][0].tolist()],
           "moved": 0.0, "summed": 0.0, "compared": 0}
    for call in range(calls):
        gen = [torch.Generator().manual_seed(1000 * call + r) for r in range(world)]
        q = [torch.randn(t, h // world, d, generator=gen[r]).to(torch.bfloat16)
             for r in range(world)]
        part = [torch.randn(t, h, d, generator=gen[r]) for r in range(world)]
        slot = call % 2
        got_node = module.gather_in_node(q[rank], slot=slot).double()
        got_full = module.gather_nodes(slot=slot).double()
        got_pnode = module.sum_nodes(part[rank], slot=slot).double()
        got_shard = module.sum_in_node(slot=slot).double()
        team = [node_of * g + j for j in range(g)]
        want_node = torch.cat([q[r].double() for r in team], dim=1)
        want_full = torch.cat([q[r].double() for r in range(world)], dim=1)
        sums = {r: sum(part[c].double() for c in [r - (r // g) * g + k * g for k in range(n)])
                for r in team}  # sum over the node team of r: its part_node before slicing
        hn = h // n
        want_pnode = sums[rank][:, node_of * hn:(node_of + 1) * hn]
        want_shard = sum(sums[r][:, node_of * hn:(node_of + 1) * hn] for r in team)[
            :, gpu_of * (hn // g):(gpu_of + 1) * (hn // g)]
        for key, got, want in (("moved", got_node, want_node), ("moved", got_full, want_full),
                               ("summed", got_pnode, want_pnode),
                               ("summed", got_shard, want_shard)):
            err = float((got - want).abs().max())  # NaN (poison) fails both bounds below
            out[key] = err if err != err else max(out[key], err)
            out["compared"] += 1
    module.close()
    return out


@pytest.mark.e2e
def test_an_engine_passes_its_per_axis_groups(two_level: type, tmp_path: Path) -> None:
    """groups= across 4 processes: the heap spans the engine's own gpu group (2 ranks,
    pointers to the gpu team only), the node steps run on its node groups; outputs of
    both kinds of step match float64 (bf16 moves exactly, fp32 sums within 1e-5)."""
    c = pipeline.run(TWO_LEVEL, pipeline.Options(worlds=[MeshWorld((2, 2))]), until="emit")
    module = tmp_path / "two_level.py"
    module.write_text(c.module_text)
    result = launch("test_axis_backends:engine_worker", 4,
                    {"module_path": str(module), "calls": 3}, timeout_s=300)
    assert result.ok, result.summary() + "".join(o.traceback or "" for o in result.outcomes)
    for rank, value in enumerate(result.values()):
        assert value["heap_world"] == 2 and value["own_group"], value
        gpu_team = [r // 2 == rank // 2 for r in range(4)]
        assert value["team_ptrs"] == [int(x) for x in gpu_team], value
        assert value["compared"] == 12 and value["moved"] == 0, value  # bf16 moved bit-exact
        assert value["summed"] <= 1e-5, value


def test_only_signalling_steps_reach_peers() -> None:
    """dcpc.runtime.axes gives a step that does not signal the symmetric kind whatever
    the mapping: sound only if such a step never reaches a peer's memory. Every gallery
    layout's generated module: a method body that names peer pointers (``_peers``,
    ``_team_peers``) or a process group belongs to a SIGNALLING step."""
    import re

    from support.gallery import header, worlds

    for path in sorted((ROOT / "schedules" / "gallery").glob("*.yaml")):
        world = worlds(header(path, "run") or "2")[0]
        c = pipeline.run(path, pipeline.Options(worlds=[world]), until="emit")
        text = c.module_text
        signalling = set(re.search(r"SIGNALLING = (\([^)]*\))", text, re.S)[1]
                         .replace("\n", "").strip("()").replace('"', "").replace(" ", "")
                         .split(",")) - {""}
        bodies = re.split(r"\n    @_rt\.guarded\n    def _checked_", text)[1:]
        assert bodies, path
        for body in bodies:
            step = body.split("(", 1)[0]
            body = body.split("\n    def ", 1)[0]
            if re.search(r"_peers|_team_comm|_comms\[", body):
                assert step in signalling, (path.name, step)


def test_a_mesh_module_on_torch_runs_on_one_rank(two_level: type) -> None:
    """The 1x1 mesh with no process group on the torch backend: its team steps get this
    rank alone (before: construction called torch.distributed.new_group, which needs an
    initialised default group)."""
    module = two_level(None, sizes=ONE, device="cpu", backend="torch")
    try:
        q = torch.randn(2, 4, 8).to(torch.bfloat16)
        assert torch.equal(module.gather_in_node(q), q)
        assert torch.equal(module.gather_nodes(), q)
    finally:
        module.close()


# ---- issue 31: a dead rank is named by every survivor, on every axis, in seconds ---------

STEPS = ("gather_in_node", "gather_nodes", "sum_nodes", "sum_in_node")


def dead_rank_worker(rank: int, world: int, module_path: str, dies_at: str, guard: bool,
                     backend: Any) -> dict[str, Any]:
    """2x2 (node x gpu), two calls; rank 3 dies (os._exit: it can tell nobody, like a
    SIGKILL) just before ``dies_at`` of the second call. The modules' own wait is an
    hour: a survivor that is not told of the death would be killed by the launcher as
    hung, never report."""
    import os

    import torch.distributed as dist

    cls = schedule_class(import_file(module_path, "dcpc_axes_dead"), "two_level")
    module = cls(dist.group.WORLD, sizes={"N": 2, "G": 2, "H": 8}, device="cpu",
                 backend=backend, guard=guard, timeout_s=3600.0)
    q, part = torch.randn(3, 2, 8).to(torch.bfloat16), torch.randn(3, 8, 8)
    args = {"gather_in_node": (q,), "gather_nodes": (), "sum_nodes": (part,),
            "sum_in_node": ()}
    try:
        for call in range(2):
            for step in STEPS:
                if call == 1 and rank == 3 and step == dies_at:
                    os._exit(17)
                getattr(module, step)(*args[step], slot=0)
        return {"error": ("none", "")}
    except Exception as exc:  # noqa: BLE001 (the test asserts on it)
        return {"error": (type(exc).__name__, str(exc))}


@pytest.mark.e2e
@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("dies_at", ["gather_in_node", "gather_nodes"])
def test_a_dead_rank_is_named_on_every_axis(two_level: type, tmp_path: Path, dies_at: str,
                                            guard: bool) -> None:
    """Before: rank 3's gpu teammate (rank 2, host shared memory) waited out its whole
    timeout (its torch-axis peers heard of the death from gloo in seconds), survivors
    named a blocked live rank, and a torch collective's error named a team-local index
    with no peer. Now a host wait watches its peers' processes (a dead one is flagged at
    once), and every message names module ranks: this rank and the peer it waited for."""
    c = pipeline.run(TWO_LEVEL, pipeline.Options(worlds=[MeshWorld((2, 2))]), until="emit")
    module = tmp_path / "two_level.py"
    module.write_text(c.module_text)
    result = launch("test_axis_backends:dead_rank_worker", 4,
                    {"module_path": str(module), "dies_at": dies_at, "guard": guard,
                     "backend": dict(MIXED)}, timeout_s=600, grace_s=240)
    statuses = [o.status for o in result.outcomes]
    assert statuses == ["ok", "ok", "ok", "died"], result.summary() + "".join(
        o.traceback or "" for o in result.outcomes)
    import re

    messages = [result.values()[rank]["error"] for rank in range(3)]
    for rank, (kind, message) in enumerate(messages):
        assert kind in ("DcpcPeerFailedError", "DcpcCollectiveError"), (rank, kind, message)
        # named by module rank, with the peer it waited for
        assert re.search(rf"rank {rank}('s [a-z_]+ with peer| stopped waiting for peer) "
                         r"\d\b", message), (rank, message)
    if dies_at == "gather_in_node":  # rank 2's gpu peer: on host shared memory
        assert ("step 'gather_in_node': rank 2 stopped waiting for peer 3 (epoch 2): peer 3 "
                "died (its process is gone") in messages[2][1], messages[2]
    else:  # rank 1's node peer (the torch axis): a team of module ranks 1 and 3
        named_dead = re.search(r"step 'gather_nodes'( \(slot 0\): rank 1's all_gather with "
                               r"peer 3 did not complete|: rank 1 stopped waiting for peer 3 "
                               r"\(epoch 2\): peer 3 is unreachable)", messages[1][1])
        # the guard's handshake waits for all four ranks: rank 2 (rank 3's host-memory
        # teammate) may see the death first and flag itself failed, and rank 1 then names
        # rank 2, whose own message must lead to the dead rank
        named_teammate = guard and re.search(
            r"step 'gather_nodes': rank 1 stopped waiting for peer 2 \(epoch 2\): peer 2 "
            r"failed \(an error in one of its calls", messages[1][1]) and re.search(
            r"peer 3 (died|is unreachable)", messages[2][1])
        assert named_dead or named_teammate, messages


# ---- issue 31 item 5: the torch handshake hides races between the kernel axes -----------

HAND_OFF_RACE = ROOT / "tests" / "mesh_backends" / "node_hand_off_race.yaml"


def test_the_race_schedule_is_one_the_checker_refuses() -> None:
    from dcpc.diagnostics import DiagnosticError

    with pytest.raises(DiagnosticError, match="write-after-read race on q_node"):
        pipeline.run(HAND_OFF_RACE, pipeline.Options(worlds=[MeshWorld((2, 2))]), until="hb")


@pytest.mark.e2e
def test_a_run_without_the_handshake_finds_the_race_between_kernel_axes() -> None:
    """Rank 1 (node 0, gpu 1) pauses before its node gather (gloo, with rank 3) in every
    call, as a descheduled rank would. Its gpu teammate rank 0, whose node gather pairs
    with rank 2, then runs the next call's in-node gather and pushes into rank 1's
    q_node before rank 1 has sent it: rank 1 and 3 get the next call's query
    (mismatches in q_full). With the handshake on (the default) every torch step first
    waits for all four ranks, rank 0 included, and the same run showed no mismatch;
    handshake=False leaves the torch step paired by its own collective only, as on
    NCCL (which has no handshake)."""
    pause = {"rank": 1, "call": -1, "step": "gather_nodes", "kind": "pause", "seconds": 0.5}
    report = run_schedule(RunConfig(schedule=str(HAND_OFF_RACE), world=MeshWorld((2, 2)),
                                    backend=dict(MIXED), calls=6, seed=1, fault=pause,
                                    handshake=False))
    out = format_report(report)
    assert report.launch.ok, out
    assert "torch handshake off" in out
    assert report.outputs["q_full"].mismatches > 0, out
