"""`when:` on communication steps (dcpc.check.when ``_matched``; docs/language.md,
"Rank-dependent steps"): proved rank by rank at every W and mesh shape checked to leave
no rank waiting, refused with a counterexample (W, the two ranks, what hangs) otherwise;
the happens-before model takes a guarded step's wait only for what a rank does once it
ran the step (dcpc.check.hb.clocks ``Gates``), so an ordering that only the skipped
ranks would miss is a race; the data flow stays exact rank by rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.gallery import worlds
from support.schedules import diagnostics

from dcpc.harness.run import RunConfig, format_report, run_schedule

MESH = """\
schedule: s
mesh: {node: N, gpu: G}
sizes: {N: {max: 4}, G: {max: 4}, T: {max: 8}, D: 8}
buffers:
  q: {shape: [T, D], dtype: f32}
  q_node: {shape: [G*T, D], dtype: f32, symmetric: true}
  out: {shape: [T, D], dtype: f32}
steps:
"""

# a group of W ranks: a gather's, a reduction's and a hand-off's buffers
LINE = """\
schedule: s
sizes: {T: {max: 8}, D: 8}
buffers:
""" + "".join(f"  {name}: {{shape: [{rows}, D], dtype: f32{more}}}\n" for name, rows, more in (
    ("x", "T", ""), ("g", "W*T", ", symmetric: true"), ("s", "T", ""),
    ("hand", "T", ", symmetric: true"), ("out", "T", ""))) + "steps:\n"

SHAPES = worlds("2x2 2x3 3x2")


def _errors(text: str, tmp_path: Path, shapes: list) -> list:
    return [d for d in diagnostics(text, tmp_path, "s.yaml", shapes) if d.severity == "error"]


def test_a_guard_on_the_coordinates_outside_the_team_is_proved(tmp_path: Path) -> None:
    """`node == 0` on a gather along gpu: every member of a team agrees, so node 0's
    teams gather and node 1's skip together; the reader guarded alike is exact."""
    text = MESH + """\
  - in_node: {op: all_gather, axis: gpu, when: "node == 0", src: q, dst: q_node}
  - use:     {op: external, when: "node == 0", reads: [q_node], writes: [out]}
  - release: {op: barrier}
"""
    assert _errors(text, tmp_path, SHAPES) == []


def test_a_guard_that_splits_a_team_is_refused_with_its_counterexample(tmp_path: Path
                                                                       ) -> None:
    text = MESH + """\
  - in_node: {op: all_gather, axis: gpu, when: "gpu == 0", src: q, dst: q_node}
  - use:     {op: external, when: "gpu == 0", reads: [q_node], writes: [out]}
  - release: {op: barrier}
"""
    found = [d for d in _errors(text, tmp_path, SHAPES) if d.code == "when-on-communication"]
    assert len(found) == 1, found
    message = found[0].message
    assert "at W=4 (mesh 2x2) the condition differs between ranks 0 and 1 (one team)" \
        in message, message
    assert "rank 1 skips 'in_node'; rank 0 runs 'in_node' and waits for rank 1's signal " \
        "forever" in message, message
    assert (found[0].mark.line, found[0].mark.col) == (9, 48)  # at the condition
    assert "'node == 0' on an all_gather along 'gpu'" in (found[0].hint or "")


@pytest.mark.parametrize("step", [
    '{op: all_reduce, reduce: sum, when: "rank == 0", src: x, dst: s}',
    '{op: barrier, when: "rank < W - 1"}',
    '{op: shift, offset: next, when: "rank % 2 == 0", src: x, dst: hand}',
])
def test_a_rank_dependent_guard_on_a_group_exchange_is_refused(tmp_path: Path,
                                                                step: str) -> None:
    found = _errors(LINE + f"  - talk: {step}\n", tmp_path, [2, 3])
    assert [d.code for d in found] == ["when-on-communication"], found
    assert "W=2" in found[0].message and "forever" in found[0].message


def test_a_guard_on_the_hop_and_w_is_proved_and_an_ordering_only_it_gives_is_not(
        tmp_path: Path) -> None:
    """The barrier that frees the gather's buffer for the next call runs at W > 2 only:
    at W = 2 nothing orders the next call's gather after this call's read (a race,
    named at W=2); the model keeps the barrier's ordering at W = 3 and 4, where every
    rank runs it."""
    text = LINE + """\
  - gather:  {op: all_gather, src: x, dst: g}
  - use:     {op: external, reads: [g], writes: [out]}
  - release: {op: barrier, when: "W > 2"}
"""
    assert _errors(text, tmp_path, [3, 4]) == []
    found = _errors(text, tmp_path, [2, 3, 4])
    # the reader's race, and the same at the gather's return (the engine reads it)
    assert {d.code for d in found} == {"race"}, found
    assert all("(W=2)" in d.message for d in found), found


def test_a_barrier_some_teams_skip_orders_nothing_for_them(tmp_path: Path) -> None:
    """The barrier along gpu runs on node 0's teams only: node 1's next gather may
    overwrite a member's buffer while it still reads it. Each rank is modelled alike,
    so the ordering the running teams have is not taken for every rank: a race."""
    text = MESH + """\
  - in_node: {op: all_gather, axis: gpu, src: q, dst: q_node}
  - use:     {op: external, reads: [q_node], writes: [out]}
  - release: {op: barrier, axis: gpu, when: "node == 0"}
"""
    found = _errors(text, tmp_path, SHAPES)
    assert {d.code for d in found} == {"race"}, found  # use's read, in_node's return
    assert all("q_node" in d.message for d in found), found
    ok = text.replace('when: "node == 0"', 'when: "N > 1"')  # every team runs it
    assert _errors(ok, tmp_path, SHAPES) == []


def test_a_read_of_what_a_skipped_team_never_gathered_is_read_before_write(
        tmp_path: Path) -> None:
    text = MESH + """\
  - in_node: {op: all_gather, axis: gpu, when: "node == 0", src: q, dst: q_node}
  - use:     {op: external, reads: [q_node], writes: [out]}
  - release: {op: barrier}
"""
    found = _errors(text, tmp_path, SHAPES)
    assert [d.code for d in found] == ["read-before-write"], found
    assert "reads 'q_node' on rank 2 at W=2x2" in found[0].message, found[0].message
    assert "do not run there (their when: does not hold): in_node" in found[0].message


SPLIT = """\
  - put:     {op: shift, when: "PUT", src: x, dst: hand, offset: next, wrap: false, phase: put}
  - wait:    {op: shift, when: "WAIT", src: x, dst: hand, offset: next, wrap: false, phase: wait}
  - use:     {op: external, when: "rank > 0", reads: [hand], writes: [out]}
  - release: {op: barrier}
"""


def test_split_halves_guarded_to_match_are_proved(tmp_path: Path) -> None:
    """A put where a next rank exists, its wait where a previous one does: on a line
    (wrap: false) every edge r -> r + 1 has both ends."""
    text = LINE + SPLIT.replace("PUT", "rank < W - 1").replace("WAIT", "rank > 0")
    assert _errors(text, tmp_path, [2, 3, 4, 5]) == []


@pytest.mark.parametrize(("put", "wait", "words"), [
    # rank 0 pushes into rank 1, which never waits: the data lands unseen
    ("rank < W - 1", "rank > 1",
     "at W=2 the condition differs between ranks 0 and 1, which it connects: rank 0 runs "
     "'put' and stores into and signals rank 1, which skips 'wait'"),
    # the last rank waits for a put its source skips
    ("rank < W - 2", "rank > 0",
     "at W=2 the condition differs between ranks 0 and 1, which it connects: rank 0 skips "
     "'put'; rank 1 runs 'wait' and waits for rank 0's signal forever"),
])
def test_split_halves_guarded_apart_are_refused_naming_the_edge(
        tmp_path: Path, put: str, wait: str, words: str) -> None:
    text = LINE + SPLIT.replace("PUT", put).replace("WAIT", wait)
    found = [d for d in _errors(text, tmp_path, [2, 3, 4])
             if d.code == "when-on-communication"]
    assert len(found) == 1, found
    assert "steps 'put' (shift, the signal) and 'wait' (shift, its wait)" in found[0].message
    assert words in found[0].message, found[0].message


# a hand-off guarded apart (review21 F1): the put runs where a next rank exists, its
# wait where a previous one does, MID between them; on the torch backend the put only
# sends and the wait only receives (dcpc.ops.shift ``_apart``)
APART = """\
schedule: apart
slots: 1
sizes: {T: 4, D: 8}
buffers:
  x:    {shape: [T, D], dtype: f32}
  y:    {shape: [T, D], dtype: f32}
  hand: {shape: [T, D], dtype: f32, symmetric: true}
  recv: {shape: [T, D], dtype: f32, symmetric: true}
  o_r:  {shape: [T, D], dtype: f32}
  o_h:  {shape: [T, D], dtype: f32}
steps:
  - put:   {op: shift, when: "rank < W - 1", HAND, phase: put}
  - mid:   MID
  - use_r: {op: external, when: "rank > 0", reads: [recv], writes: [o_r]}
  - wait:  {op: shift, when: "rank > 0", HAND, phase: wait}
  - use_h: {op: external, when: "rank > 0", reads: [hand], writes: [o_h]}
  - done:  {op: barrier}
""".replace("HAND", "src: x, dst: hand, offset: next, wrap: false")


@pytest.mark.parametrize(("mid", "kind"), [
    # a receive from the put's sender: it would take the put's message (gloo: a size
    # mismatch in the handshake, or the data swapped without it)
    ("{op: shift, src: y, dst: recv, offset: next, wrap: false}", "shift"),
    # a collective: the sender's send blocks until the receiver's wait, which waits
    # behind the barrier for the sender (a crash, or a hang without the handshake)
    ("{op: barrier}", "barrier"),
])
def test_a_step_that_communicates_between_a_put_and_its_wait_guarded_apart_is_located(
        tmp_path: Path, mid: str, kind: str) -> None:
    text = APART.replace("MID", mid)
    found = [d for d in _errors(text, tmp_path, [2, 3, 4, 5, 6])
             if d.code == "wait-first-span"]
    assert len(found) == 1, found
    (refused,) = found
    at = text.splitlines().index(next(ln for ln in text.splitlines()
                                      if ln.startswith("  - put:")))
    assert (refused.mark.line, refused.mark.col) == (at + 1, text.splitlines()[at].index(
        '"rank < W - 1"') + 1)
    assert ("step 'put' puts and its wait 'wait' has another 'when:' (at W=2 rank 0 puts "
            f"at 'put' and rank 1 receives it at 'wait'), but step 'mid' ({kind}) "
            "between them communicates") in refused.message, refused.message
    assert "move 'mid' before 'put' or after 'wait'" in (refused.hint or "")


def test_a_step_between_on_neither_end_of_the_apart_pair_is_refused_saying_so(
        tmp_path: Path) -> None:
    """Rank 0 puts to rank 1 only; the split shift between runs on ranks 2 and up: it
    cannot take that message, and the refusal (by where the step stands: the same class,
    at the put's when:) says so and where it runs, not that it would take the message."""
    text = APART.replace('"rank < W - 1"', '"rank == 0"').replace(
        '"rank > 0"', '"rank == 1"').replace("  - mid:   MID\n", """\
  - mid:   {op: shift, when: "rank >= 2", src: y, dst: recv, offset: next, wrap: false, phase: put}
  - mid_w: {op: shift, when: "rank >= 3", src: y, dst: recv, offset: next, wrap: false, phase: wait}
""").replace('use_r: {op: external, when: "rank == 1"', 'use_r: {op: external, when: "rank >= 3"')
    found = [d for d in _errors(text, tmp_path, [3, 4, 5]) if d.code == "wait-first-span"]
    assert len(found) == 1, found
    (refused,) = found
    lines = text.splitlines()
    at = lines.index(next(ln for ln in lines if ln.startswith("  - put:")))
    assert (refused.mark.line, refused.mark.col) == (at + 1, lines[at].index('"rank == 0"') + 1)
    assert ("(at W=3 rank 0 puts at 'put' and rank 1 receives it at 'wait'), but step 'mid' "
            "(shift) between them communicates (it signals, waits or reaches another rank's "
            "buffers), though on neither end of any such pair at a W checked (at W=3 it runs "
            "on rank 2), so it cannot take this put's message; it is refused by where it "
            "stands") in refused.message, refused.message
    assert "would take the put's message" not in refused.message
    assert "move 'mid' before 'put' or after 'wait'" in (refused.hint or "")


def test_a_put_and_its_wait_guarded_apart_adjacent_or_local_between_are_proved(
        tmp_path: Path) -> None:
    assert _errors(APART.replace("MID", "{op: copy, src: y, dst: recv}"), tmp_path,
                   [2, 3, 4, 5, 6]) == []
    adjacent = APART.replace("  - mid:   MID\n", "").replace(
        '  - use_r: {op: external, when: "rank > 0", reads: [recv], writes: [o_r]}\n', "")
    assert _errors(adjacent, tmp_path, [2, 3, 4, 5, 6]) == []


@pytest.mark.parametrize(("mid", "refused"), [
    ("{op: barrier}", True), ("{op: external, reads: [q], writes: [out]}", False)])
def test_a_put_and_its_wait_guarded_apart_along_an_axis_name_the_mesh(
        tmp_path: Path, mid: str, refused: bool) -> None:
    """Along gpu of a mesh: the same rule, the world named with its mesh shape."""
    text = MESH.replace("q_node: {shape: [G*T, D]", "q_node: {shape: [T, D]") + f"""\
  - put:   {{op: shift, axis: gpu, when: "gpu < G - 1", HAND, phase: put}}
  - mid:   {mid}
  - wait:  {{op: shift, axis: gpu, when: "gpu > 0", HAND, phase: wait}}
  - use:   {{op: external, when: "gpu > 0", reads: [q_node], writes: [out]}}
  - done:  {{op: barrier}}
""".replace("HAND", "src: q, dst: q_node, offset: next, wrap: false")
    found = [d for d in _errors(text, tmp_path, SHAPES) if d.code == "wait-first-span"]
    assert len(found) == int(refused), found
    if refused:
        assert ("(at W=4 (mesh 2x2) rank 0 puts at 'put' and rank 1 receives it at "
                "'wait'), but step 'mid' (barrier)") in found[0].message, found[0].message


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "host", "local"])
@pytest.mark.parametrize("world", [2, 3])
def test_dcpc_run_of_a_put_and_its_wait_guarded_apart_matches_float64(
        tmp_path: Path, backend: str, world: int) -> None:
    """Only a local step between (a copy): the torch backend's put sends and its wait
    receives with nothing to take the message in between."""
    path = tmp_path / "apart.yaml"
    path.write_text(APART.replace("MID", "{op: copy, src: y, dst: recv}"))
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend=backend,
                                    calls=3, seed=world))
    shown = format_report(report)
    assert report.ok, shown
    assert report.outputs["hand@use_h"].compared > 0, shown
    assert all(o.mismatches == 0 for o in report.outputs.values()), shown


RING = Path(__file__).resolve().parents[2] / "schedules" / "ops" / "when_ring_attention.yaml"


@pytest.mark.parametrize(("edit", "code", "words"), [
    # no credit: the put of hop h + 1 may overwrite the block the receiver still attends
    (("        - credit: {op: wait, from: next, channel: free}\n", ""), "race", "recv"),
    # the wait of the last send guarded off: its put lands where nobody waits
    (('arrive: {op: shift, when: "h < W - 1"', 'arrive: {op: shift, when: "h < W - 2"'),
     "when-on-communication", "rank 0 runs 'send_h0' and stores into and signals rank 1, "
     "which skips 'arrive_h0'"),
])
def test_the_one_loop_ring_s_wrong_twins_are_refused(tmp_path: Path, edit: tuple,
                                                       code: str, words: str) -> None:
    """schedules/ops/when_ring_attention.yaml (vLLM's `for step in range(W)` with the send
    while step + 1 != W) is proved (tests/ops); without its credit, or with the wait of
    its last send guarded off, it is refused."""
    text = RING.read_text()
    assert edit[0] in text
    found = [d for d in _errors(text.replace(*edit), tmp_path, [2, 3, 4]) if d.code == code]
    assert found, code
    assert words in found[0].message, found[0].message


BARRIERS = [  # a barrier some W or some teams skip: a race there, found by both
    (LINE + """\
  - gather:  {op: all_gather, src: x, dst: g}
  - use:     {op: external, reads: [g], writes: [out]}
  - release: {op: barrier, when: "W > 2"}
""", "2 3"),
    (MESH + """\
  - in_node: {op: all_gather, axis: gpu, src: q, dst: q_node}
  - use:     {op: external, reads: [q_node], writes: [out]}
  - release: {op: barrier, axis: gpu, when: "node == 0"}
""", "2x2"),
]
OPS = Path(__file__).resolve().parents[2] / "schedules" / "ops"


@pytest.mark.parametrize(("text", "shapes"), [
    *BARRIERS,
    ((OPS / "when_communication.yaml").read_text(), "2 3 4"),
    ((OPS / "when_communication_axis.yaml").read_text(), "2x2 2x3"),
    (RING.read_text(), "2 3 4"),
], ids=["barrier_w", "barrier_team", "ops", "ops_axis", "ring"])
def test_the_exact_models_agree_on_guarded_exchanges(text: str, shapes: str) -> None:
    """The execution oracle (dcpc.check.oracle: the plan run rank by rank) and the brute
    force (tests/support/hb_oracle.py: every rank's events, every edge), each leaving a
    skipped step's accesses, signals and waits out, reach exactly the races the
    checker reports (none in the op files; the skipped barrier's at W=2 and on node
    1's teams)."""
    from support.exec_oracle_agree import disagreements
    from support.hb_oracle import oracle_keys

    from dcpc.check import hb
    from dcpc.lang.parse import parse_text

    for world in worlds(shapes):
        schedule = parse_text(text, world=world)
        assert disagreements(schedule, [world]) == [], world
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert oracle_keys(schedule, world) == found, world
        if text.startswith(LINE) and int(world) == 2 or text.startswith(MESH):
            assert {key[0] for key in found} == {"race"}, world


@pytest.mark.parametrize(("name", "shapes"), [
    ("reduce", "2 3 4"), ("reduce_scatter", "2 3 4"), ("pull_split", "2 3 4"),
    ("sync", "2 3 4"), ("reduce_axis", "2x2 3x2"), ("broadcast_axis", "2x2 2x3"),
])
def test_each_collective_guarded_by_w_is_proved(tmp_path: Path, name: str, shapes: str
                                                ) -> None:
    """Every communication step of an op file guarded by a condition on W and the axis
    sizes (each team agrees): proved, a root's reads and stores (a reduce's via)
    taken on the root only by the per-rank data flow."""
    import re

    text = (OPS / f"{name}.yaml").read_text()
    cond = '"N > 1"' if "mesh:" in text else '"W > 2"'
    ops = "barrier|signal|wait" if name == "sync" else \
        "reduce_scatter|reduce|pull|broadcast|barrier|signal|wait"  # sync's readers: unguarded
    guarded, n = re.subn(rf"\{{op: ({ops})\b",
                         lambda m: f"{{op: {m.group(1)}, when: {cond}", text)
    assert n >= 2, name
    assert _errors(guarded, tmp_path, worlds(shapes)) == []


# random schedules of guarded exchanges: the checker is sound against the brute force
POOL = [
    "{op: all_gather, src: x, dst: g, when: COMM}",
    "{op: external, reads: [g], writes: [out], when: ANY}",
    "{op: all_reduce, reduce: sum, src: x, dst: s, when: COMM}",
    "{op: barrier, when: COMM}",
    "{op: shift, offset: next, src: x, dst: hand, when: COMM}",
    "{op: external, reads: [hand], writes: [out], when: ANY}",
    "{op: external, writes: [x], when: ANY}",
    # neighbours swap: rank-dependent, each pair runs it or not as one
    '{op: shift, perm: "r + 1 - 2 * (r % 2)", src: x, dst: hand, when: PAIR}',
]
PAIR = ['"rank < 2"', '"rank > 1"', '"W > 2"']
COMM = ['"W > 2"', '"W < 4"', '"W % 2 == 0"']
ANY = [*COMM, '"rank > 0"', '"rank % 2 == 0"']


def test_the_checker_is_sound_on_random_guarded_exchanges() -> None:
    """Random sequences of guarded gathers, reductions, barriers, shifts and engine steps
    (each guard drawn at random, a communication step's from conditions on W): every
    race and deadlock the brute force finds at W = 2, 3, 4, the checker reports (it may
    report more: a guarded wait orders only what runs after it where it runs; on these
    it reported exactly the brute force's)."""
    import random

    from support.hb_oracle import oracle_keys

    from dcpc.check import hb, structural
    from dcpc.lang.parse import parse_text

    tried = racing = perms = 0
    for seed in range(12):
        rng = random.Random(seed)
        for _ in range(24):
            lines = []
            for k in range(rng.randint(3, 6)):
                step = rng.choice(POOL)
                if rng.random() < 0.3:
                    step = step.replace(", when: COMM", "").replace(", when: ANY", "")
                step = step.replace("COMM", rng.choice(COMM)).replace("ANY", rng.choice(ANY))
                step = step.replace("PAIR", rng.choice(PAIR)).replace(", when: PAIR", "")
                lines.append(f"  - s{k}: {step}\n")
            text = LINE + "".join(lines)
            for world in (2, 3, 4):  # a perm: one schedule per W
                schedule = parse_text(text, "s.yaml", world=world)
                if any(d.severity == "error" for d in structural.check(schedule, [world])):
                    continue  # refused before the race analysis (read-before-write, ...)
                found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
                brute = oracle_keys(schedule, world)
                assert not brute - found, (world, brute - found, text)
                tried, racing = tried + 1, racing + bool(brute)
                perms += "perm:" in text
    assert tried >= 100 and racing >= 20 and perms >= 20, (tried, racing, perms)


# the same, with a loop of two hops around some steps (guards on its hop index) and slots
HOP_COMM = ['"h == 0"', '"h < W - 2"', '"h == 1 or W % 2 == 1"']
HOP_ANY = [*HOP_COMM, '"h + rank < 3"', '"h == rank"']


def test_the_checker_is_sound_on_random_guarded_exchanges_in_loops() -> None:
    """As above, the steps after the first in a loop of two hops whose own when: (or the
    steps') names the hop index (a loop's guard conjoined with each step's), at one to
    three slots on their own streams or one stream: every race and deadlock the brute
    force finds at W = 2, 3, 4, the checker reports (96 schedule-W pairs analysed, 33
    racing, 54 with several slots)."""
    import random

    from support.hb_oracle import oracle_keys

    from dcpc.check import hb, structural
    from dcpc.lang.parse import parse_text

    tried = racing = slotted = 0
    for seed in range(8):
        rng = random.Random(100 + seed)
        for _ in range(12):
            slots, streams = rng.randint(1, 3), rng.choice(["per_slot", "single"])
            lines, inner = [], []
            for k in range(rng.randint(3, 5)):
                step = rng.choice(POOL)
                hop = bool(lines)  # every step after the first in the loop
                if rng.random() < 0.3:
                    step = step.replace(", when: COMM", "").replace(", when: ANY", "")
                step = step.replace("COMM", rng.choice(HOP_COMM if hop else COMM))
                step = step.replace("ANY", rng.choice(HOP_ANY if hop else ANY))
                step = step.replace("PAIR", rng.choice(PAIR)).replace(", when: PAIR", "")
                (inner if hop else lines).append(f"s{k}: {step}")
            loop_when = rng.choice(["", *(f"\n      when: {c}" for c in HOP_COMM)])
            text = (LINE.replace("schedule: s\n", f"schedule: s\nslots: {slots}\n"
                                 f"streams: {streams}\n")
                    + "".join(f"  - {s}\n" for s in lines)
                    + f"  - hops:\n      repeat: 2\n      as: h{loop_when}\n      steps:\n"
                    + "".join(f"        - {s}\n" for s in inner))
            for world in (2, 3, 4):
                schedule = parse_text(text, "s.yaml", world=world)
                if any(d.severity == "error" for d in structural.check(schedule, [world])):
                    continue
                found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
                brute = oracle_keys(schedule, world)
                assert not brute - found, (world, brute - found, text)
                tried, racing = tried + 1, racing + bool(brute)
                slotted += slots > 1
    assert tried >= 80 and racing >= 20 and slotted >= 40, (tried, racing, slotted)
