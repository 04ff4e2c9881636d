"""A communication step whose slice names the rank (issue 33 item 4): an index of a
symmetric buffer whose leading axis is W that is a ROTATION of the rank (``r + c`` mod W,
one c on every rank) names the buffer ``<b>_rot<c>`` (dcpc.lang.loops ``_rotated``): one
step that every rank runs, no copies per rank, so a shift may take the sender's slot as
``src`` and the receiver's view of the sender as ``dst``. schedules/ops/shift_rank_index.yaml
(a ring all-gather in place, every block in its owner's slot) is proved, its twin without
the barrier is refused with a counterexample, and the checker, the brute force and the
execution oracle agree on both; any other index of the rank on a communication step stays
``bad-index``, and a buffer indexed by rotations and otherwise keeps the copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.hb_oracle import oracle_keys

from dcpc.check import hb, structural
from dcpc.check.oracle import explore
from dcpc.cli import main
from dcpc.codegen.lower import lower
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import simulate_call
from dcpc.lang.parse import parse_file, parse_text
from dcpc.topology import MeshWorld

ROOT = Path(__file__).resolve().parents[2]
RING = ROOT / "schedules" / "ops" / "shift_rank_index.yaml"
BARRIER = "  - done: {op: barrier}\n"


def _twin(tmp_path: Path) -> Path:
    """The ring without its barrier: the call that reuses a slot (call c + 2) stores
    into the owner's slot while the call before it may still be passing that block."""
    text = RING.read_text()
    assert text.endswith(BARRIER)
    path = tmp_path / "shift_rank_index.no_barrier.yaml"
    path.write_text(text.removesuffix(BARRIER))
    return path


def test_a_rotation_of_the_rank_is_one_step_every_rank_runs() -> None:
    schedule = parse_file(RING, 3)
    steps = {s.name: s for s in schedule.step_list()}
    assert list(steps) == ["own", "pass_h0", "pass_h1", "done"]  # no copies per rank
    assert all(getattr(s.op, "when", None) is None for s in steps.values())
    # hop h: src is slot r - h (c = -h), dst on the receiver slot r - h - 1 (c = -h - 1)
    assert (steps["own"].op.dst, steps["pass_h0"].op.src, steps["pass_h0"].op.dst,
            steps["pass_h1"].op.src, steps["pass_h1"].op.dst) == (
        "parts_rot0", "parts_rot0", "parts_rot2", "parts_rot2", "parts_rot1")
    assert "parts" not in schedule.buffers
    assert all(schedule.buffers[f"parts_rot{c}"].shape == ["N", "D"] for c in range(3))


def test_the_ring_is_proved_and_its_twin_without_the_barrier_is_a_located_race(
        tmp_path: Path) -> None:
    done = CliRunner().invoke(main, ["check", str(RING), "--world", "2..5"])
    assert done.exit_code == 0, done.output
    twin = _twin(tmp_path)
    done = CliRunner().invoke(main, ["check", str(twin), "--world", "2..4"])
    out = done.output
    assert done.exit_code == 1, out
    assert f"{twin}:30:11: error: write-after-write race on parts_rot1" in out, out
    assert "pass_h0 on rank 1 (call 0) and pass_h0 on rank 1 (call 2)" in out, out
    assert "parts_rot1[rank 0, slot 0] whole (shift from rank 1, offset +1)" in out, out
    assert "a legal execution" in out and "[race]" in out, out


@pytest.mark.parametrize("racy", [False, True], ids=["clean", "no_barrier"])
def test_checker_brute_force_and_execution_oracle_agree_on_the_rotated_ring(
        racy: bool, tmp_path: Path) -> None:
    """The three follow each slot on each rank (the per-rank renaming is one-to-one), so
    they find the same races: none with the barrier, the slot reuse without it."""
    path = _twin(tmp_path) if racy else RING
    for world in (2, 3, 4):
        schedule = parse_file(path, world)
        assert [d for d in structural.check(schedule, [world]) if d.severity == "error"] == []
        checker = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert checker == oracle_keys(schedule, world), world
        executed = {f.key for f in explore(lower(schedule, [world]), world,
                                           randoms=2).findings}
        assert checker == executed, world
        assert bool(checker) is racy, (world, checker)


@pytest.mark.parametrize("backend", ["torch", "local"])
def test_the_ring_runs_against_float64(backend: str) -> None:
    """host runs in tests/ops/test_op_schedules.py (the file's '# run:' worlds)."""
    report = run_schedule(RunConfig(schedule=str(RING), world=3, backend=backend, calls=5))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    for c in range(3):  # every slot on every rank is compared
        assert f"parts_rot{c}" in text, text


def test_a_pull_of_every_rank_s_rotated_slot_is_one_step_too(tmp_path: Path) -> None:
    """Nothing in the rotation is the shift's: a pull reads slot (p + 1) mod W of every
    rank p (its src, 'parts[(r + 1) % W]'), one step, proved and run against float64."""
    path = tmp_path / "pull_rotation.yaml"
    path.write_text(RING.read_text().split("steps:")[0].replace(
        "op_shift_rank_index", "pull_rotation")
        + "  got: {shape: [W, N, D], dtype: bf16}\nsteps:\n"
        '  - own: {op: copy, src: mine, dst: "parts[(r + 1) % W]"}\n'
        '  - fetch: {op: pull, src: "parts[(r + 1) % W]", dst: got}\n'
        "  - read: {op: signal, to: all, channel: pulled}\n"
        "  - freed: {op: wait, from: all, channel: pulled}\n")
    schedule = parse_file(path, 3)
    assert [s.name for s in schedule.step_list()] == ["own", "fetch", "read", "freed"]
    done = CliRunner().invoke(main, ["check", str(path), "--world", "2..4"])
    assert done.exit_code == 0, done.output
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend="torch", calls=5))
    assert report.launch.ok and report.mismatches == 0, format_report(report)


# one shift into a slot of g that names the rank (INDEX), read on the receiver
SHIFT = ("schedule: rotation\nslots: 2\nsizes: {T: 3, C: 8}\n"
         "buffers: {x: {shape: [T, C], dtype: f32}, "
         "g: {shape: [W, T, C], dtype: f32, symmetric: true}}\nsteps:\n"
         '  - send: {op: shift, src: x, dst: "INDEX", offset: next}\n'
         "  - done: {op: barrier}\n")


@pytest.mark.parametrize(("index", "why"), [
    ("g[W - 1 - r]", "r=0 gives c=3, r=1 gives c=1"),
    ("g[(2 * r) % W]", "r=0 gives c=0, r=1 gives c=1")])
def test_an_index_of_the_rank_that_is_no_rotation_stays_bad_index(index: str, why: str
                                                                   ) -> None:
    schedule = parse_text(SHIFT.replace("INDEX", index), "s.yaml", 4)
    found = [d for d in structural.check(schedule, [4]) if d.severity == "error"]
    assert [d.code for d in found] == ["bad-index"], found
    assert f"('{index}' is no rotation r + c mod W (at W=4: {why}))" in found[0].message
    assert "rotation of the rank ('parts[(r - h) % W]'" in (found[0].hint or ""), found[0]


def test_a_rotation_copied_for_a_fixed_use_of_its_buffer_locates_that_use() -> None:
    text = SHIFT.replace("src: x, dst: \"INDEX\"", "src: \"g[1]\", dst: \"g[(r + 1) % W]\"")
    schedule = parse_text(text, "s.yaml", 3)
    found = [d for d in structural.check(schedule, [3]) if d.code == "bad-index"]
    assert len(found) == 1, found
    assert ("('g' is also used at s.yaml:6:28 otherwise than by a rotation, so its rank "
            "indices are copies per rank)") in found[0].message, found[0]


def test_the_receiver_s_slot_of_the_sender_is_its_own_rotation() -> None:
    """dst 'g[(r - 1) % W]' read on the receiver is the sender's rank: one step."""
    schedule = parse_text(SHIFT.replace("INDEX", "g[(r - 1) % W]"), "s.yaml", 4)
    assert [s.name for s in schedule.step_list()] == ["send", "done"]
    assert schedule.step_list()[0].op.dst == "g_rot3"
    assert [d for d in structural.check(schedule, [4]) if d.severity == "error"] == []


def test_a_buffer_indexed_by_a_rotation_and_a_fixed_slice_keeps_the_copies() -> None:
    """At W=2 'g[r % 2]' is a rotation, but g[0] is taken too: the slices keep their
    names on every rank and the step is copied per rank, as at every other W."""
    text = SHIFT.replace("INDEX", "g[0]").replace(
        "  - done", "  - use: {op: external, reads: [\"g[r % 2]\"], writes: [x]}\n  - done")
    schedule = parse_text(text, "s.yaml", 2)
    assert [s.name for s in schedule.step_list()] == ["send", "use_r0", "use_r1", "done"]
    assert not any("_rot" in b for b in schedule.buffers)


def test_a_rotation_named_like_a_declared_buffer_is_mixed_index() -> None:
    text = SHIFT.replace("INDEX", "g[r]").replace(
        "buffers: {x:", "buffers: {g_rot0: {shape: [T, C], dtype: f32}, x:")
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", 3)
    assert [d.code for d in err.value.diagnostics] == ["mixed-index"]
    assert "rotated slice of 'g'" in err.value.diagnostics[0].message


def test_the_step_bound_counts_a_rotation_once_and_anything_else_once_per_rank() -> None:
    """The bound from the trip counts takes an index written as a rotation ('(r + E) %
    W') of a symmetric buffer whose leading axis is W as the one step it is (the ring at
    W=20: 21 steps, not 20 per hop); any other index of the rank there counts once per
    rank, so the loop is refused before any step is unrolled, as for any copies."""
    assert len(parse_file(RING, 20).step_list()) == 21
    text = SHIFT.replace("INDEX", "g[r]").replace(
        "  - send: {op: shift, src: x, dst: \"g[r]\", offset: next}\n",
        "  - hops:\n      repeat: W\n      as: h\n      steps:\n"
        "        - fill: {op: copy, src: x, dst: \"g[(W - 1 - r + h) % W]\"}\n")
    assert len(parse_text(text, "s.yaml", 3).step_list()) == 3 * 3 + 1
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", 23)
    assert [d.code for d in err.value.diagnostics] == ["loop-too-long"]
    assert ("unrolls to 23 hops x 23 steps = 529 steps (a step whose index names the rank "
            "counts once per rank) (at W=23)") in err.value.diagnostics[0].message


def test_a_rotated_buffer_also_used_whole_is_counted_with_its_copies() -> None:
    """12 hops x 20 rotations of g fit the bound as rotations, but g is also used whole,
    so its rank indices are copies per rank: refused from the trip counts (12 x 20 x W),
    before the unroller takes any copy (W=1024 unrolled 20 copies of W per hop)."""
    reads = "".join(f"        - rd{k}: {{op: copy, src: \"g[(r + h + {k}) % W]\", dst: x}}\n"
                    for k in range(20))
    text = SHIFT.replace("INDEX", "g[r]").replace(
        "  - send: {op: shift, src: x, dst: \"g[r]\", offset: next}\n",
        f"  - hops:\n      repeat: 12\n      as: h\n      steps:\n{reads}"
        "  - whole: {op: copy, src: g, dst: g}\n")
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", 1024)
    assert [d.code for d in err.value.diagnostics] == ["loop-too-long"]
    assert "12 hops x 20480 steps" in err.value.diagnostics[0].message
    assert "(at W=1024)" in err.value.diagnostics[0].message


def test_a_rotation_on_an_axis_team_of_a_mesh_is_refused() -> None:
    """On 'axis: gpu' of a mesh of several axes r is the rank in the whole mesh, not in
    the gpu team: '(r + W - 1) % W' would not name the team's sender."""
    text = ("schedule: mesh_rot\nmesh: {node: N, gpu: G}\nslots: 2\n"
            "sizes: {T: 3, D: 8}\nbuffers:\n  mine: {shape: [T, D], dtype: f32}\n"
            "  parts: {shape: [W, T, D], dtype: f32, symmetric: true}\nsteps:\n"
            '  - own: {op: copy, src: mine, dst: "parts[r]"}\n'
            '  - hand: {op: shift, src: "parts[r]", dst: "parts[(r + W - 1) % W]", '
            "offset: next, axis: gpu}\n  - done: {op: barrier}\n")
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", MeshWorld((2, 2)))
    found = err.value.diagnostics
    assert [(d.code, d.mark.line, d.mark.col) for d in found] == [
        ("bad-index", 10, 28), ("bad-index", 10, 45)], found
    assert "'parts[(r + W - 1) % W]' rotates the rank on a step along mesh axis 'gpu'" in (
        found[1].message) and "whole mesh" in found[1].message


def test_on_rank_r_the_rotation_c_holds_rank_r_plus_c_s_block() -> None:
    """The layout the module's docstring states: after the ring, parts_rot<c> on rank r
    is the block of rank (r + c) mod W, in the float64 reference, and the backends match
    that reference (test_the_ring_runs_against_float64: 0 mismatches on every slot)."""
    world = 3
    schedule = parse_file(RING, world)
    g = torch.Generator().manual_seed(0)
    inputs = [{"mine": torch.randn(4, 40, generator=g, dtype=torch.float64)
               .to(torch.bfloat16).double()} for _ in range(world)]
    out = simulate_call(schedule, world, {"N": 4, "D": 40}, inputs, external=None)  # type: ignore[arg-type]
    for r in range(world):
        for c in range(world):
            assert torch.equal(out[r][f"parts_rot{c}"], inputs[(r + c) % world]["mine"]), (r, c)


def buffer_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """The compiled ring on the torch backend: module.buffer of the user's name and of a
    rotation."""
    import torch.distributed as dist
    from support.kernels import load, the_class

    m = the_class(load(path))(dist.group.WORLD, sizes={"N": 4}, device="cpu",
                              backend="torch")
    try:
        m.buffer("parts")
        message = ""
    except KeyError as err:
        message = str(err)
    shape = tuple(m.buffer("parts_rot1").shape)
    m.close()
    return {"message": message, "shape": shape}


def test_the_module_says_how_it_holds_the_rotated_buffer(tmp_path: Path) -> None:
    """No buffer 'parts' in the module: its header lists the rotations and what each is,
    and module.buffer('parts') raises a KeyError that says so; a rotation is a buffer."""
    from dcpc.harness.launch import launch

    done = CliRunner().invoke(main, ["compile", str(RING), "--world", "2", "-o",
                                     str(tmp_path)])
    assert done.exit_code == 0, done.output
    path = tmp_path / "op_shift_rank_index.py"
    header = " ".join(line.lstrip("# ").strip() for line in path.read_text().splitlines()
                      if line.startswith("#"))
    assert ("parts (symmetric, leading axis W) is held as parts_rot0, parts_rot1: on rank "
            "r, parts_rot<c> is slot (r + c) mod W of parts") in header, header
    result = launch("test_rank_rotation:buffer_worker", 2, {"path": str(path)},
                    timeout_s=240, gloo_timeout_s=120)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    for outcome in result.outcomes:
        assert "no module-owned buffer 'parts'; it is held as parts_rot0, parts_rot1: on " \
            "rank r, parts_rot<c> is slot (r + c) mod W of parts" in outcome.value["message"]
        assert outcome.value["shape"] == (4, 40), outcome.value
