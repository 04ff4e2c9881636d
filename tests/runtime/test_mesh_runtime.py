"""A generated module of a mesh schedule binds its mesh shape at construction (issue 21
item 1, runtime): the axes' sizes come in ``sizes=``, multiply to the group's size, and
fix every team op's team; one rank (no group) is the 1x1 mesh. Runs across processes
are the gallery's (tests/cli/test_gallery.py, host backend at 2x2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpc import pipeline
from dcpc.lang.mesh import MeshWorld
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.loading import import_file, schedule_class

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def helix(tmp_path_factory: pytest.TempPathFactory) -> type:
    c = pipeline.run(ROOT / "schedules" / "gallery" / "helix.yaml",
                     pipeline.Options(worlds=[MeshWorld((2, 2))]), until="emit")
    path = tmp_path_factory.mktemp("mesh") / "helix.py"
    path.write_text(c.module_text)
    return schedule_class(import_file(str(path), "dcpc_generated_helix_mesh"), "helix")


def test_the_module_knows_its_mesh_and_teams(helix: type) -> None:
    assert helix.MESH == (("kvp", "KVP"), ("tpa", "TPA"))
    assert helix.TEAMS == {"out_exchange": (0,)}
    assert helix.SIZES["KVP"] == ("axis", 0) and helix.SIZES["TPA"] == ("axis", 1)


def test_a_mesh_that_is_not_the_group_is_refused(helix: type) -> None:
    with pytest.raises(DcpcArgumentError, match=r"kvp=2 x tpa=2 has 4 ranks.*group has 1"):
        helix(None, sizes={"KVP": 2, "TPA": 2, "H": 4, "E": 4}, device="cpu", backend="host")
    with pytest.raises(DcpcArgumentError, match="sizes mesh axis 'kvp'"):
        helix(None, sizes={"TPA": 1, "H": 4, "E": 4}, device="cpu", backend="host")


def test_one_rank_is_a_mesh_of_ones(helix: type) -> None:
    module = helix(None, sizes={"KVP": 1, "TPA": 1, "H": 4, "E": 4}, device="cpu",
                   backend="host")
    try:
        assert module.mesh_shape == (1, 1)
        assert module._team("out_exchange") == ([0], 0)
        assert module._team_size("out_exchange") == 1
    finally:
        module.close()


def test_next_prev_along_an_axis_of_size_one_wait_for_nobody() -> None:
    """Review finding: on a 1x2 mesh, `wait from: prev` along the axis of size 1 before its
    signal passed `dcpc check` (a team of one has no next/prev peer) while the kernel
    waited for its own signal (DcpcTimeoutError on both ranks). The kernel now has no
    next/prev lane in a team of one, as the checker models it."""
    from dcpc.harness.run import RunConfig, format_report, run_schedule

    path = Path(__file__).parents[1] / "mesh_cases" / "axis_of_one_credit.yaml"
    pipeline.run(path, pipeline.Options(worlds=[MeshWorld((1, 2))]), until="hb")  # proved
    report = run_schedule(RunConfig(schedule=str(path), world=MeshWorld((1, 2)),
                                    backend="host", calls=2, seed=3, timeout_s=120))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
