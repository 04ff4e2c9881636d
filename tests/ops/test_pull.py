"""pull, a remote read (issue 33 item 2): every rank reads every peer's symmetric src out
of the peer's memory. Proved at W 2..8 with its credit; without the credit the next
call's write of src is a write-after-read race (the read modelled as a read of every
rank's instance, Region "whole"), and the execution oracle agrees; the kernels touch
what the plan says (a load from a peer's instance needs that region); runs on the CPU
backends match float64 bit for bit; bad keys are located errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from support.exec_oracle_agree import disagreements
from support.hb_oracle import oracle_keys
from support.schedules import first_error

from dcpc import pipeline
from dcpc.check import hb
from dcpc.codegen.plan import dump_plan
from dcpc.diagnostics import DiagnosticError
from dcpc.harness import trace as tr
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file, parse_text
from dcpc.lang.semantics import Region, semantics
from dcpc.ops.common import effects

ROOT = Path(__file__).resolve().parents[2]
PULL = ROOT / "schedules" / "ops" / "pull.yaml"
AXIS = ROOT / "schedules" / "ops" / "pull_axis.yaml"
CREDIT = ("  - read:", "  - freed:")  # the credit: signal after the pulls, wait at the end


def _without_credit() -> str:
    return "".join(line for line in PULL.read_text().splitlines(keepends=True)
                   if not line.startswith(CREDIT))


def test_the_pull_schedule_is_proved_for_w_2_to_8() -> None:
    c = pipeline.run(PULL, pipeline.Options(worlds=list(range(2, 9))), until="hb")
    assert c.hb_report is not None and c.hb_report.findings == []


def test_the_read_is_of_every_rank_s_src_after_the_wait() -> None:
    schedule = parse_file(PULL)
    step = next(s for s in schedule.step_list() if s.name == "pull_y")
    sem = semantics(schedule, step)
    assert sem.sync.signal == "all" and sem.sync.wait == "all" and sem.sync.polls == step.index
    assert [(e.buffer, e.kind, e.when, e.region) for e in sem.effects] == [
        ("y_sym", "read", "after", Region("whole", 0)), ("y_all", "write", "after", None)]
    with pytest.raises(ValueError, match="remote read"):  # a region "whole" is reads only
        effects("write", "after", [("y_sym", "dst")], Region("whole", 0))


def test_an_edited_plan_that_writes_a_whole_region_is_refused_as_a_mismatch(
        tmp_path: Path) -> None:
    """A plan file is input: an effect edited to a 'whole' write is plan-mismatch, located,
    never an internal error."""
    out = pipeline.run(PULL, pipeline.Options(worlds=[2]), until="lower")
    text = dump_plan(out.plan).replace('"kind": "read"', '"kind": "write"')
    assert '"scheme": "whole"' in text
    plan = tmp_path / "plan.json"
    plan.write_text(text)
    with pytest.raises(DiagnosticError) as err:
        pipeline.run_plan(PULL, plan, until="hb")
    assert [d.code for d in err.value.diagnostics] == ["plan-mismatch"], err.value.diagnostics


def test_rewriting_src_without_the_credit_is_a_write_after_read_race() -> None:
    text = _without_credit()
    twin = parse_text(text, "twin.yaml")
    report = hb.check(twin, list(range(2, 9)), hints=False)
    # y_sym only: pull_y's wait orders every peer's earlier pull_x read before the next
    # stage_x, so x_sym needs no credit of its own
    assert [f.key for f in report.findings] == [
        ("race", "write-after-read", "y_sym", "pull_y", "stage_y")]
    (found,) = report.findings
    assert found.world == 2
    diag = found.diagnostic()
    line = text.splitlines().index(
        next(s for s in text.splitlines() if s.startswith("  - stage_y:"))) + 1
    assert (diag.mark.line, diag.mark.col) == (line, 5), diag
    assert diag.message.startswith("write-after-read race on y_sym: stage_y on rank 0 "
                                   "(call 2) can write y_sym[rank 0, slot 0] while pull_y on "
                                   "rank 1 (call 0) still reads it"), diag.message
    assert found.first.region.endswith("the whole buffer (a remote read by rank 1)")
    # the execution oracle runs the plan's slots and epochs and finds the same (and
    # nothing in the schedule with its credit); so does the brute force, which models the
    # read on its own (every member's src after the reader's waits)
    assert disagreements(twin, [2, 3, 4]) == []
    assert disagreements(parse_file(PULL), [2, 3, 4]) == []
    for world in (2, 3, 4):
        assert oracle_keys(twin, world) == {f.key for f in report.findings}, world
        assert oracle_keys(parse_file(PULL), world) == set(), world


def test_the_kernels_read_peers_where_the_plan_says() -> None:
    run = tr.run_traced(str(PULL), 3, programs=3, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems
    # the tracer has teeth: the same read said to be of this rank's own instance only
    plan = dataclasses.replace(run.plan, steps=[
        dataclasses.replace(s, effects=[dataclasses.replace(e, region=None) if e.region
                                        else e for e in s.effects])
        if s.op == "pull" else s for s in run.plan.steps])
    problems = tr.check(run.trace, plan, 3)
    assert any("reads rank" in p and "instance of 'y_sym'" in p for p in problems), problems



def test_a_team_pull_reads_its_team_only() -> None:
    """On a 2x2 mesh the kernels read their team's instances (the tracer asks each read
    of a peer's instance for a region whose team holds that peer); the same trace against
    a plan whose gpu pull is said to read over node is refused on every cross-team read."""
    run = tr.run_traced(str(AXIS), MeshWorld((2, 2)), programs=2, block=256, calls=1)
    assert run.mismatches == 0 and run.problems == [], run.problems
    node = next(e.region.axes for s in run.plan.steps if s.name == "nodes"
                for e in s.effects if e.region is not None)
    plan = dataclasses.replace(run.plan, steps=[
        dataclasses.replace(s, effects=[dataclasses.replace(
            e, region=dataclasses.replace(e.region, axes=node)) if e.region else e
            for e in s.effects]) if s.name == "in_node" else s for s in run.plan.steps])
    problems = tr.check(run.trace, plan, MeshWorld((2, 2)))
    assert problems and all("step 'in_node'" in p and "not in its team" in p
                            for p in problems), problems

# variants of pull.yaml: an integer payload over i64's whole range, bit for bit
VARIANTS = {
    "": [],
    "i64": [(f"{name} dtype: bf16", f"{name} dtype: i64") for name in (
        "x:      {shape: [T, D],   ", "x_sym:  {shape: [T, D],   ", "x_all:  {shape: [W, T, D],")],
}


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend", "variant"), [
    (2, "host", ""), (3, "host", ""), (4, "host", ""), (3, "torch", ""), (3, "local", ""),
    (2, "host", "i64"),
    (MeshWorld((2, 3)), "host", "axis"), (MeshWorld((3, 2)), "torch", "axis")], ids=str)
def test_dcpc_run_matches_float64_bit_for_bit(world: int | MeshWorld, backend: str,
                                              variant: str, tmp_path: Path) -> None:
    source = AXIS if variant == "axis" else PULL
    path, text = tmp_path / source.name, source.read_text()
    for old, new in VARIANTS.get(variant, []):
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend=backend,
                                    calls=5, seed=7, programs=2, sizes={"T": 24}))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    moved = ["x_gpus", "x_nodes", "x_all"] if variant == "axis" else ["x_all", "y_all", "y_sum"]
    for name in moved:  # a move is compared bit for bit (OpDef.exact); y_sum is a sum
        stats = report.outputs[name]
        assert stats.compared == 5 * int(world), (name, text)
        assert stats.max_abs_err == 0.0 or name == "y_sum", (name, text)


def test_over_teams_the_credit_less_twin_races_on_every_team_s_pull() -> None:
    """pull_axis.yaml without its last pull and barrier: each team pull's read of src
    races the next call's stage (the brute force, teams computed on its own, and the
    execution oracle agree on 2x2, 2x3 and 3x2)."""
    text = "".join(line for line in AXIS.read_text().splitlines(keepends=True)
                   if not line.startswith(("  - every:", "  - release:")))
    twin = parse_text(text, "twin.yaml")
    want = {("race", "write-after-read", "x_sym", pull, "stage") for pull in ("in_node", "nodes")}
    for world in (MeshWorld((2, 2)), MeshWorld((2, 3)), MeshWorld((3, 2))):
        assert {f.key for f in hb.check(twin, [world], hints=False).findings} == want, world
        assert oracle_keys(twin, world) == want, world
        assert disagreements(twin, [world]) == [], world
    # the reader is named by its index in its team, and said to be one (it said "rank")
    texts = ["\n".join(f.timeline) for f in hb.check(twin, [MeshWorld((2, 3))],
                                                   hints=False).findings]
    assert all("a remote read by team member" in m for m in texts), texts


HEAD = """\
schedule: s
sizes: {T: {max: 8}, D: 4}
buffers:
  x:     {shape: [T, D], dtype: f32}
  x_sym: {shape: [T, D], dtype: f32, symmetric: true}
  x_all: {shape: [W, T, D], dtype: f32}
  x_bf:  {shape: [W, T, D], dtype: bf16}
  x_bad: {shape: [T, W, D, 1], dtype: f32}
steps:
  - stage: {op: copy, src: x, dst: x_sym}
"""


@pytest.mark.parametrize(("step", "code", "col"), [
    ("{op: pull, src: x_sym, dst: x_all, bogus: 1}", "unknown-key", 46),
    ("{op: pull, src: x, dst: x_all}", "not-symmetric", 27),
    ("{op: pull, src: x_sym, dst: x_bad}", "shape-mismatch", 39),
    ("{op: pull, src: x_sym, dst: x_all, dim: 1}", "shape-mismatch", 39),
    ("{op: pull, src: x_sym, dst: x_all, dim: 3}", "dim-out-of-range", 51),
    ("{op: pull, src: x_sym, dst: x_all, dim: -3}", "dim-out-of-range", 51),  # means 0
    ("{op: pull, src: x_sym, dst: x_bf}", "dtype-mismatch", 39),
    ("{op: pull, src: [x_sym], dst: x_all}", "wrong-type", 27),
    ("{op: pull, src: x_sym}", "missing-key", 11),
])
def test_bad_keys_are_located_errors(step: str, code: str, col: int) -> None:
    text = HEAD + f"  - pull: {step}\n"
    assert first_error(text) == [(code, text.count("\n"), col)]
