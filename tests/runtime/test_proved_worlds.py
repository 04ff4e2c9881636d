"""A module refuses a group outside the worlds it was proved for (``WORLDS``): the
checker's verdict holds at the W (or mesh shapes) it unrolled, not beyond, and before
this a module checked for W 2..8 constructed at W = 10 ran unproved. A group of one
rank has no peer and stays served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.kernels import construct_on_local_ranks

from dcpc import pipeline
from dcpc.harness.worker import load_module_class

ROOT = Path(__file__).resolve().parents[2]


def _module(tmp_path: Path, schedule: str, worlds: list[Any]) -> type:
    path = ROOT / "schedules" / schedule
    c = pipeline.run(path, pipeline.Options(worlds=worlds))
    out = tmp_path / f"{path.stem}.py"
    out.write_text(c.module_text)
    return load_module_class(str(out), c.schedule.schedule)


def _construct(cls: type, world: int, sizes: dict[str, int]) -> dict[int, str]:
    return construct_on_local_ranks(cls, world, lambda rank: sizes)


def test_a_world_outside_the_proof_is_refused_on_every_rank(tmp_path: Path) -> None:
    cls = _module(tmp_path, "ops/all_gather.yaml", [2, 4])
    assert cls.WORLDS == (2, 4)
    said = _construct(cls, 3, {})
    assert set(said) == {0, 1, 2}
    for text in said.values():
        assert "proved and compiled for W 2, 4, but the group is 3" in text, text
        assert "--world 3" in text
    assert set(_construct(cls, 2, {}).values()) == {"constructed"}
    cls(None, sizes={}, device="cpu", backend="host").close()  # one rank: no peer


def test_a_mesh_shape_outside_the_proof_is_refused(tmp_path: Path) -> None:
    from dcpc.lang.mesh import MeshWorld

    cls = _module(tmp_path, "gallery/hierarchical_two_level.yaml", [MeshWorld((2, 2))])
    assert cls.WORLDS == ((2, 2),)
    said = _construct(cls, 6, {"N": 2, "G": 3, "H": 6})
    assert len(said) == 6 and all("but the group is 2x3" in t for t in said.values()), said
