"""One module for several W: a schedule whose loops name W, compiled once for W 2..4,
holds one class per W and serves each of them from the same file (docs/language.md,
Hop loops; issue 33 item 3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dcpc import pipeline
from dcpc.harness.run import RunConfig, run_schedule
from dcpc.run_limits import RunConfigError

ROOT = Path(__file__).resolve().parents[2]
RING = ROOT / "schedules/gallery/ring_attention.yaml"
SHIFT_RING = ROOT / "schedules/ops/shift_ring.yaml"
WORLDS = [2, 3, 4]


def _compile(path: Path, out: Path, worlds: list[int]) -> Path:
    c = pipeline.run(path, pipeline.Options(worlds=worlds), until="emit")
    assert c.schedule is not None and c.module_text is not None
    target = out / f"{c.schedule.schedule}.py"
    target.write_text(c.module_text)
    return target


@pytest.mark.e2e
@pytest.mark.parametrize("path", [RING, SHIFT_RING], ids=lambda p: p.stem)
def test_one_module_compiled_for_w_2_to_4_runs_at_each_against_float64(
        path: Path, tmp_path: Path) -> None:
    module = _compile(path, tmp_path, WORLDS)  # before: loop-world, "a module needs one --world N"
    for world in WORLDS:  # every rank constructs the file's class, which picks its W's
        report = run_schedule(RunConfig(schedule=str(path), world=world, backend="local",
                                        calls=3, seed=world, module=str(module)))
        assert report.ok and report.mismatches == 0, (world, report.errors())
        assert report.compile_s == 0.0  # run from the file, not compiled again
        compared = sum(s.compared for s in report.outputs.values())
        assert compared > 0, world


def test_a_w_outside_the_compiled_range_is_refused_at_construction(tmp_path: Path) -> None:
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.local import LocalGroup, LocalRank

    module = _compile(RING, tmp_path, WORLDS)
    cls = load_module_class(str(module), "ring_attention")
    assert cls.__name__ == "RingAttention" and sorted(cls.LOOP_WORLDS) == WORLDS
    assert [cls.for_world(w).LOOP_WORLD for w in WORLDS] == WORLDS
    assert hasattr(cls.for_world(4), "send_h1") and not hasattr(cls.for_world(3), "send_h1")
    with pytest.raises(ValueError, match=r"unrolled for each W in 2, 3, 4 .* the group has "
                                         r"5 ranks; compile it with --world 5"):
        cls(LocalRank(LocalGroup(5, "cpu"), 0), sizes={"T": 1, "N": 1}, device="cpu")
    with pytest.raises(RunConfigError, match=r"--module .* group has 5 ranks"):
        run_schedule(RunConfig(schedule=str(RING), world=5, backend="local", calls=1,
                               module=str(module)))


def test_a_module_of_another_text_is_refused(tmp_path: Path) -> None:
    module = _compile(RING, tmp_path, WORLDS)
    other = tmp_path / "ring.yaml"
    other.write_text(RING.read_text() + "\n# an edit\n")
    with pytest.raises(RunConfigError, match="compiled from another text"):
        run_schedule(RunConfig(schedule=str(other), world=2, backend="local", calls=1,
                               module=str(module)))


def test_kernels_and_methods_the_same_at_several_w_are_written_once(tmp_path: Path) -> None:
    multi = _compile(RING, tmp_path, WORLDS).read_text()
    singles = []
    for world in WORLDS:
        (tmp_path / str(world)).mkdir()
        singles.append(_compile(RING, tmp_path / str(world), [world]).read_text())
    assert multi.count("\ndef _send_first_kernel(") == 1  # before the loop: one text
    assert multi.count("\ndef _send_h0_kernel(") == 1  # a hop of W 3 and 4, the same text
    for world in WORLDS:  # after the loop a step's index shifts with W: one kernel per W
        assert f"\ndef _credit_end_kernel_w{world}(" in multi
        assert f"    _credit_end_kernel_w{world}[" in multi  # its W's class calls it
    assert "\ndef _credit_end_kernel(" not in multi
    # a method the same at several W lives in a base class of exactly those W's classes
    assert multi.count("\n    def send_first(") == 1 and multi.count("\n    def send_h0(") == 1
    assert multi.count("\n    def credit_end(") == 3
    assert "class _RingAttention_W2(_RingAttention_Shared_W2to4, _rt.ScheduleModule):" in multi
    assert ("class _RingAttention_W4(\n    _RingAttention_Shared_W2to4, "
            "_RingAttention_Shared_W3_4, _rt.ScheduleModule\n):") in multi
    assert "class RingAttention(_rt.ModuleOfWorlds):" in multi
    names = re.findall(r"^(?:def|class) (\w+)", multi, re.M)
    assert len(names) == len(set(names))
    lines, summed = multi.count("\n"), sum(s.count("\n") for s in singles)
    assert lines < summed, (lines, summed)
    for world, single in zip(WORLDS, singles, strict=True):
        assert f"    LOOP_WORLD = {world}\n" in single and "LOOP_WORLDS" not in single


def test_a_mesh_loop_over_w_compiles_a_class_per_w_for_several_shapes(tmp_path: Path) -> None:
    from test_loops_nested import MESH

    from dcpc.worlds import parse_worlds

    path = tmp_path / "by_w.yaml"
    path.write_text(MESH.replace("repeat: G - 1", "repeat: W - 3"))  # names W, no axis size
    text = pipeline.run(path, pipeline.Options(worlds=parse_worlds("2x2,2x3,3x2"))).module_text
    assert "    LOOP_WORLD = 4\n" in text and "    LOOP_WORLD = 6\n" in text  # 2x3, 3x2: one
    assert text.count("    LOOP_WORLD = ") == 2 and "# checked for W in 2x2, 2x3, 3x2," in text
    assert "        4: _MeshLoop_W4,\n        6: _MeshLoop_W6,\n" in text


def test_a_module_of_one_w_is_as_before(tmp_path: Path) -> None:
    text = _compile(RING, tmp_path, [3]).read_text()
    assert "class RingAttention(_rt.ScheduleModule):" in text and "ModuleOfWorlds" not in text
    assert "    LOOP_WORLD = 3\n" in text



def test_a_module_is_refused_at_a_world_it_was_not_proved_for(tmp_path: Path) -> None:
    """A module compiled (and proved) for W=3 run at W=2: its float64 reference died on
    an index (a broadcast's root 2 is no rank at W=2) where the proof said nothing; it
    is refused, naming the worlds the module holds."""
    path = tmp_path / "root_two.yaml"
    path.write_text("schedule: root_two\nsizes: {T: {max: 8}, D: 16}\nbuffers:\n"
                    "  x: {shape: [T, D], dtype: f32}\n"
                    "  d: {shape: [T, D], dtype: f32, symmetric: true}\n"
                    "steps:\n  - bc: {op: broadcast, src: x, dst: d, root: 2}\n"
                    "  - release: {op: barrier}\n")
    module = _compile(path, tmp_path, [3])
    with pytest.raises(RunConfigError, match=r"proved and compiled for W 3, not --world 2"):
        run_schedule(RunConfig(schedule=str(path), world=2, backend="local", calls=1,
                               module=str(module)))
