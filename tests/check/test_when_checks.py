"""Rank-dependent steps (``when:``) in the checker: the data flow rank by rank, and the
races of guarded schedules as the brute force (tests/support/hb_oracle.py, exact per
rank) and the execution oracle (dcpc/check/oracle.py, exact per rank) find them at
W = 2, 3, 4; a counterexample names ranks where its steps run."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.hb_oracle import oracle_keys, oracle_unwritten
from support.schedules import check_errors

from dcpc.check import hb, structural
from dcpc.check.oracle import explore
from dcpc.codegen.lower import lower
from dcpc.lang.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
ZIGZAG = ROOT / "schedules" / "gallery" / "zigzag_ring_attention.yaml"
TWINS = sorted((ROOT / "tests" / "gallery_twins").glob("zigzag_ring_attention.*.yaml"))

HEAD = """\
schedule: s
sizes: {N: 4, D: 2}
buffers:
  x: {shape: [N, D], dtype: f32}
  y: {shape: [N, D], dtype: f32}
  g: {shape: [W * N, D], dtype: f32, symmetric: true}
  s: {shape: [N, D], dtype: f32, symmetric: true}
steps:
"""


def _flow(steps: str) -> list:
    return check_errors(HEAD + steps, range(2, 6))


@pytest.mark.parametrize("steps", [
    # the same guard on the writer and the reader
    '  - make: {op: external, when: "rank % 2 == 0", reads: [x], writes: [s]}\n'
    '  - use: {op: external, when: "rank % 2 == 0", reads: [s], writes: [y]}\n',
    # a reader whose guard implies the writer's
    '  - make: {op: external, when: "rank % 2 == 0", reads: [x], writes: [s]}\n'
    '  - use: {op: external, when: "rank == 0 or rank == 2", reads: [s], writes: [y]}\n',
    # two writers whose guards cover every rank
    '  - even: {op: external, when: "rank % 2 == 0", reads: [x], writes: [s]}\n'
    '  - odd: {op: external, when: "rank % 2 == 1", reads: [x], writes: [s]}\n'
    '  - use: {op: external, reads: [s], writes: [y]}\n',
    # a guarded reader of what every rank wrote
    '  - make: {op: external, reads: [x], writes: [s]}\n'
    '  - use: {op: external, when: "rank < W - 1", reads: [s], writes: [y]}\n',
])
def test_a_read_each_rank_makes_after_its_own_write_is_clean(steps: str) -> None:
    assert _flow(steps) == []


@pytest.mark.parametrize(("steps", "rank", "world", "skipped"), [
    # the reader runs on the last rank, the writer not
    ('  - make: {op: external, when: "rank < W - 1", reads: [x], writes: [s]}\n'
     '  - use: {op: external, reads: [s], writes: [y]}\n', 1, 2, "make"),
    # off by one: hop h's merge where its partial is not made (the zigzag twin's mistake)
    ('  - make: {op: external, when: "1 > rank", reads: [x], writes: [s]}\n'
     '  - use: {op: external, when: "1 >= rank", reads: [s], writes: [y]}\n', 1, 2, "make"),
    # the writer comes after the read on that rank
    ('  - use: {op: external, when: "rank == 1", reads: [s], writes: [y]}\n'
     '  - make: {op: external, when: "rank == 1", reads: [x], writes: [s]}\n', 1, 2, ""),
])
def test_a_read_on_a_rank_its_writer_skips_is_read_before_write(
        steps: str, rank: int, world: int, skipped: str) -> None:
    found = _flow(steps)
    assert [d.code for d in found] == ["read-before-write"], found
    message = found[0].message
    assert f"on rank {rank} at W={world}" in message, message
    if skipped:
        assert f"do not run there (their when: does not hold): {skipped}" in message
    else:
        assert "no earlier step writes it" in message
    assert found[0].mark.line == HEAD.count("\n") + (2 if skipped else 1)  # the read


def test_the_per_rank_flow_agrees_with_the_brute_force() -> None:
    """A symmetric buffer a guarded step writes: the checker and the brute force refuse
    the same reads (and no other)."""
    for steps, refused in [
        ('  - make: {op: external, when: "rank < W - 1", reads: [x], writes: [s]}\n'
         '  - use: {op: external, reads: [s], writes: [y]}\n', True),
        ('  - make: {op: external, when: "rank < W - 1", reads: [x], writes: [s]}\n'
         '  - use: {op: external, when: "rank + 1 < W", reads: [s], writes: [y]}\n', False),
    ]:
        schedule = parse_text(HEAD + steps)
        checker = bool([d for d in structural.check(schedule, range(2, 5))
                        if d.code == "read-before-write"])
        assert checker is refused, steps
        for world in (2, 3, 4):
            brute = oracle_unwritten(schedule, world)
            assert (brute == {("read-before-write", "", "s", "use", "")}) is refused, (
                steps, world, brute)


RACY = [
    # a guarded reader of a gathered buffer with nothing after it: the next call's
    # gather overwrites it while the reading ranks may still read it
    '  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n'
    '  - use: {op: external, when: "rank == W - 1", reads: [g], writes: [y]}\n',
    # a guarded step that runs on no rank races nothing (the checker drops it per W)
    '  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n'
    '  - use: {op: external, when: "rank >= W", reads: [g], writes: [y]}\n',
    # one that runs from W = 3 on only: a race at W 3 and 4, none at W 2
    '  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n'
    '  - use: {op: external, when: "rank == 2", reads: [g], writes: [y]}\n',
    # the same, with the credit that orders it: clean everywhere
    '  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n'
    '  - use: {op: external, when: "rank == 2", reads: [g], writes: [y]}\n'
    '  - done: {op: barrier}\n',
]


@pytest.mark.parametrize("steps", RACY, ids=range(len(RACY)))
def test_checker_brute_force_and_execution_oracle_agree_on_guarded_races(steps: str) -> None:
    schedule = parse_text(HEAD.replace("  s: {shape: [N, D], dtype: f32, symmetric: true}\n",
                                       "") + steps)
    assert [d for d in structural.check(schedule, range(2, 5)) if d.severity == "error"] == []
    for world in (2, 3, 4):
        checker = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        brute = oracle_keys(schedule, world)
        executed = {f.key for f in explore(lower(schedule, [world]), world,
                                           randoms=2).findings}
        assert checker == brute == executed, (steps, world, checker, brute, executed)
    if "rank == 2" in steps and "barrier" not in steps:  # use's race (the gather's own,
        # at its return, is there at every W: the engine reads what it returns)
        def use(w: int) -> list:
            return [f for f in hb.check(schedule, [w], hints=False).findings
                    if "use" in f.key[3:]]
        assert not use(2)
        assert use(3)


@pytest.mark.parametrize("path", [ZIGZAG, *TWINS], ids=lambda p: p.stem)
def test_zigzag_and_its_twins_agree_with_both_oracles(path: Path) -> None:
    """The gallery's causal zigzag ring (guarded attends and merges): clean, its twin
    without the hop credit racing from W = 4 on, as all three find."""
    for world in (2, 3, 4):
        schedule = parse_file(path, world)
        if "wrong_guard" in path.stem:  # its error is the data flow's, not a race
            assert [d.code for d in structural.check(schedule, [world])
                    if d.severity == "error"] == (["read-before-write"] * 2 if world > 2
                                                  else [])
            continue
        checker = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert checker == oracle_keys(schedule, world), (path.name, world)
        executed = {f.key for f in explore(lower(schedule, [world]), world,
                                           randoms=2).findings}
        assert checker == executed, (path.name, world)
        assert bool(checker) is ("no_hop_credit" in path.stem and world >= 4)


def test_a_race_s_counterexample_names_ranks_where_its_steps_run() -> None:
    """The analysis takes a guarded step's accesses on every rank and finds races on
    rank 0's instance; the report rotates the race to ranks where both steps run (so
    the execution it prints happens, and `dcpc run --replay` can hold that step)."""
    twin = ROOT / "tests" / "gallery_twins" / "zigzag_ring_attention.no_hop_credit.yaml"
    schedule = parse_file(twin, 4)
    for f in hb.check(schedule, [4], hints=False).findings:
        for loc in (f.first, f.second):
            step = next(s for s in schedule.step_list() if s.name == loc.step)
            when = step.op.when
            if when is None:
                continue
            # lower (s <= r) runs on ranks >= s, upper (s > r) on ranks < s
            s = int(when.split()[0])
            assert (loc.rank >= s) if "<=" in when else (loc.rank < s), (f.message, when)
    # and its timeline shows a guarded step a rank passes over as skipped, not done
    lines = "\n".join(next(f for f in hb.check(schedule, [4], hints=False).findings
                          if f.key[3] == "attend_lower_h0").timeline)
    assert "rank 0: call 0 " in lines and "attend_lower_h0 (skipped)" in lines, lines
    assert "attend_lower_h0 ✓" not in lines.split("rank 1:")[0], lines


MESH = """\
schedule: m
mesh: {node: N, gpu: G}
sizes: {N: {max: 4}, G: {max: 4}, T: 4, D: 2}
buffers:
  x: {shape: [T, D], dtype: f32}
  g: {shape: [G, T, D], dtype: f32, symmetric: true}
  z: {shape: [T, D], dtype: f32}
steps:
  - gather: {op: all_gather, src: x, dst: g, dim: 0, axis: gpu}
  - lead: {op: external, when: "gpu == 0 and node < N", reads: [g], writes: [z]}
"""


@pytest.mark.parametrize(("when", "tail", "racy"), [
    ("gpu == 0 and node < N", "", True),
    ("gpu == 0 and node < N", "  - done: {op: barrier}\n", False),
    ("gpu >= G", "", False),  # runs on no rank: no race
])
def test_a_condition_on_mesh_coordinates_agrees_with_both_oracles(
        when: str, tail: str, racy: bool) -> None:
    """On a mesh a condition reads each axis' coordinate (and size): the checker, the
    brute force and the execution oracle agree at 2x2 and 2x3 (no rotation there: the
    counterexample is the model's)."""
    from dcpc.topology import MeshWorld

    schedule = parse_text(MESH.replace("gpu == 0 and node < N", when) + tail)
    assert [d for d in structural.check(schedule, [MeshWorld((2, 2))])
            if d.severity == "error"] == []
    for shape in ((2, 2), (2, 3)):
        world = MeshWorld(shape)
        checker = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert checker == oracle_keys(schedule, world), (shape, checker)
        executed = {f.key for f in explore(lower(schedule, [world]), world,
                                           randoms=2).findings}
        assert checker == executed, (shape, checker, executed)
        assert any("lead" in k[3:] for k in checker) is racy  # (the gather's return
        # races without the barrier: the engine reads what it returns)


PIPE = """\
schedule: pipe
sizes: {N: 4, D: 2}
buffers:
  x: {shape: [N, D], dtype: f32}
  act: {shape: [N, D], dtype: f32}
  recv: {shape: [N, D], dtype: f32, symmetric: true}
  y: {shape: [N, D], dtype: f32}
steps:
  - stage: {op: external, reads: [x], writes: [act]}
  - hand: {op: shift, src: act, dst: recv, offset: next, wrap: false}
  - consume: {op: external, when: "WHEN", reads: [recv], writes: [y]}
  - credit: {op: signal, to: prev, channel: free}
  - freed: {op: wait, from: next, channel: free}
"""


@pytest.mark.parametrize(("when", "refused"), [("rank > 0", False), ("rank >= 0", True),
                                                ("rank != 0 and rank < W", False)])
def test_a_pipeline_stage_consumes_only_where_it_received(when: str, refused: bool) -> None:
    """The pipeline hand-off (a shift without wrap: stage 0 receives nothing) with the
    consumer guarded to the stages that receive: clean; guarded so that stage 0 reads
    too: read-before-write on rank 0, naming the shift whose store does not reach it;
    the brute force finds the same (before, any read of recv after a shift without wrap
    was refused, guarded or not)."""
    schedule = parse_text(PIPE.replace("WHEN", when))
    found = [d for d in structural.check(schedule, range(2, 5)) if d.severity == "error"]
    if refused:
        assert [d.code for d in found] == ["read-before-write"], found
        assert "on rank 0 at W=2" in found[0].message
        assert "the stores of hand do not reach it there" in found[0].message
    else:
        assert found == []
    for world in (2, 3, 4):
        brute = oracle_unwritten(schedule, world)
        assert bool(brute) is refused, (when, world, brute)
        if not refused:
            assert {f.key for f in hb.check(schedule, [world], hints=False).findings} \
                == oracle_keys(schedule, world) == set()


# ---- found by the review of this change ------------------------------------------------
@pytest.mark.parametrize(("steps", "rank", "world"), [
    # a partial perm's store counted on every rank once a guarded step read its dst:
    # proved, and dcpc run's float64 reference then read a buffer nothing wrote
    ('  - hand: {op: shift, src: x, dst: s, perm: "r + 1"}\n'
     '  - use: {op: external, when: "rank < W - 1", reads: [s], writes: [y]}\n', 0, 2),
    ('  - swap: {op: shift, src: x, dst: s, perm: "r + 1 - 2 * (r % 2)"}\n'
     '  - use: {op: external, when: "rank >= 0", reads: [s], writes: [y]}\n', 2, 3),
    # a symmetric buffer updated in place on a rank its writer's guard skips
    ('  - init: {op: external, when: "rank == 0", reads: [x], writes: [s]}\n'
     '  - merge: {op: external, when: "rank < W", reads: [s, x], writes: [s]}\n', 1, 2),
])
def test_a_read_no_store_reaches_on_some_rank_is_refused(steps: str, rank: int,
                                                          world: int) -> None:
    schedule = parse_text(HEAD + steps, world=world)  # a perm: one schedule per W
    (err,) = [d for d in structural.check(schedule, [world]) if d.severity == "error"]
    assert err.code == "read-before-write"
    assert f"on rank {rank} at W={world}" in err.message, err.message
    assert oracle_unwritten(schedule, world), "the brute force agrees"


def test_a_symmetric_buffer_updated_in_place_first_is_read_before_write() -> None:
    """The module's symmetric buffer holds nothing this call wrote when a step's in-place
    update is its first access (an engine buffer so updated is an input: clean)."""
    (err,) = _flow('  - merge: {op: external, reads: [s, x], writes: [s]}\n'
                   '  - use: {op: external, reads: [s], writes: [y]}\n')
    assert err.code == "read-before-write" and "updates it in place" in err.message
    assert _flow('  - merge: {op: external, reads: [y, x], writes: [y]}\n') == []


@pytest.mark.parametrize(("move", "guard", "refused"), [
    ('perm: "r + 1"', "rank < W - 1", False),
    ("offset: 1, wrap: false", "rank < W - 1", False),
    ('perm: "r + 1"', "rank < W - 2", True),  # rank W - 2 sends what it did not make
    ("offset: 1, wrap: false", "rank < W - 2", True),
])
def test_a_push_reads_its_source_only_on_the_ranks_that_send(move: str, guard: str,
                                                           refused: bool) -> None:
    """A partial perm's (or a line's) source is read by the ranks whose store goes
    somewhere: the last rank sends nothing, so its unwritten src is no error there (it
    was refused at every W); the checker and the brute force agree rank by rank."""
    head = HEAD.replace("steps:\n", "  t: {shape: [N, D], dtype: f32, symmetric: true}\n"
                        "steps:\n")
    steps = (f'  - make: {{op: external, when: "{guard}", reads: [x], writes: [s]}}\n'
             f"  - send: {{op: shift, src: s, dst: t, {move}}}\n"
             '  - done: {op: barrier}\n')
    for world in (2, 3, 4):
        schedule = parse_text(head + steps, world=world)
        found = [d for d in structural.check(schedule, [world]) if d.severity == "error"]
        assert [d.code for d in found] == ["read-before-write"] * refused, (world, found)
        if refused:
            assert f"'send' reads 's' on rank {world - 2} at W={world}" in found[0].message
        assert bool(oracle_unwritten(schedule, world)) is refused, (world, "brute force")


@pytest.mark.parametrize("move", ['perm: "W - 1 - r"', "offset: 1"])
def test_a_guarded_read_of_a_store_in_flight_names_its_wait(move: str) -> None:
    """A guarded read between a put and its wait: the reason is the data in flight
    (it said 'the stores of put do not reach it there (a shift without wrap...)')."""
    steps = (f"  - put: {{op: shift, src: x, dst: s, {move}, phase: put}}\n"
             '  - use: {op: external, when: "rank == 0", reads: [s], writes: [y]}\n'
             f"  - land: {{op: shift, src: x, dst: s, {move}, phase: wait}}\n"
             "  - done: {op: barrier}\n")
    schedule = parse_text(HEAD + steps, world=3)
    (err,) = [d for d in structural.check(schedule, [3]) if d.severity == "error"]
    assert err.code == "read-before-write"
    assert err.message.endswith("on rank 0 at W=3, where nothing the call ran before wrote "
                                "it; the data of 'put' is in flight until its wait 'land', "
                                "after 'use'"), err.message
    assert err.hint == "move step 'use' after 'land'"
    assert oracle_unwritten(schedule, 3), "the brute force agrees"


def test_a_perm_that_skips_the_reading_rank_says_so() -> None:
    schedule = parse_text(HEAD + '  - swap: {op: shift, src: x, dst: s, perm: '
                          '"r + 1 - 2 * (r % 2)"}\n  - use: {op: external, when: '
                          '"rank >= 0", reads: [s], writes: [y]}\n', world=3)
    (err,) = [d for d in structural.check(schedule, [3]) if d.severity == "error"]
    assert err.message.endswith("the stores of swap do not reach it there (a perm in which "
                                "rank 2 is no destination)"), err.message
