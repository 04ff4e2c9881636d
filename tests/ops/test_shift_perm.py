"""shift by a fixed permutation (`perm:`, JAX's ppermute; issue 33 item 2): the forms
(an expression of r and W with `%`, [source, destination] pairs, a destination table),
their located errors, the semantics (a store into perm(r)'s instance only), the checker
against the brute force (tests/support/hb_oracle.py) and the execution oracle (every race
they find, the checker reports; deadlocks agree), the float64 reference, the traced
kernels and `dcpc run` on the host and torch backends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import checker_covers
from support.hb_oracle import oracle_keys, oracle_unwritten, random_shift_schedule_text
from support.schedules import run_clean, shift_head

from dcpc.check import hb, structural
from dcpc.diagnostics import DiagnosticError
from dcpc.harness import simulate
from dcpc.harness import trace as tr
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang import expr as ex
from dcpc.lang.parse import parse_file, parse_text
from dcpc.lang.semantics import Region, semantics

ROOT = Path(__file__).resolve().parents[2]
PERM = ROOT / "schedules" / "ops" / "shift_perm.yaml"
PAIRS = ROOT / "tests" / "shift" / "perm_pairs.yaml"  # fixes W = 4: not a conformance file
PARTIAL = ROOT / "schedules" / "ops" / "shift_perm_partial.yaml"

HEAD = shift_head()
# one perm step, a use of its dst and (CREDIT) a barrier that frees it for the next call
ONE = HEAD + "  - hop: {op: shift, src: x, dst: y, perm: PERM}\n" \
    "  - use: {op: external, reads: [y], writes: [z]}\n"
CREDIT = "  - done: {op: barrier}\n"


def _errors(text: str, world: int | None) -> list:
    try:
        schedule = parse_text(text, "s.yaml", world)
    except DiagnosticError as err:
        return list(err.diagnostics)
    return [d for d in structural.check(schedule, [world] if world else range(2, 5))
            if d.severity == "error"]


def _findings(text: str, world: int) -> set:
    return {f.key for f in hb.check(parse_text(text, world=world), [world],
                                    hints=False).findings}


# --- the forms and their errors -------------------------------------------------------

def test_percent_is_an_operator_only_where_asked() -> None:
    assert ex.evaluate(ex.parse("(r + W / 2) % W", modulo=True), {"r": 3, "W": 4}) == 1
    assert ex.evaluate(ex.parse("W - 1 - r % 2", modulo=True), {"r": 3, "W": 4}) == 2
    with pytest.raises(ex.ExprSyntaxError, match="unexpected character '%'"):
        ex.parse("N % 2")  # shapes, trip counts and offsets stay without


@pytest.mark.parametrize("perm,world,table", [
    ('"W - 1 - r"', 4, [3, 2, 1, 0]),
    ('"(r + W / 2) % W"', 4, [2, 3, 0, 1]),
    ('"r + 1 - 2 * (r % 2)"', 3, [1, 0, -1]),  # swapped pairs: rank 2 has no partner
    ('"r + 1"', 3, [1, 2, -1]),  # off the group: sends nothing
    ("[[0, 1], [1, 0], [2, 3]]", 4, [1, 0, 3, -1]),
    ("[2, -1, 0]", 3, [2, -1, 0]),
])
def test_every_form_unrolls_to_the_destination_table(perm: str, world: int,
                                                      table: list[int]) -> None:
    schedule = parse_text(ONE.replace("PERM", perm) + CREDIT, world=world)
    hop = schedule.step_list()[0]
    assert hop.op.perm == table
    sem = semantics(schedule, hop)
    (store,) = [e for e in sem.effects if e.kind == "write"]
    assert store.region == Region("perm", 0, table=tuple(table))
    inverse = [table.index(r) if r in table else -1 for r in range(world)]
    assert (sem.sync.signal, sem.sync.wait) == (
        "perm:" + ",".join(map(str, table)), "perm:" + ",".join(map(str, inverse)))


@pytest.mark.parametrize("perm,world,code,words", [
    ('"(2 * r) % W"', 4, "bad-perm", "sends ranks 0 and 2 both to rank 0 at W=4"),
    ("[[0, 1], [1, 1]]", 2, "bad-perm", "sends ranks 0 and 1 both to rank 1 at W=2"),
    ("[[0, 1], [0, 2], [2, 0]]", 3, "bad-perm", "rank 0 is the source of two pairs"),
    ('"(r + W / 2) % W"', 3, "bad-perm", "W/2 is 3/2"),
    ('"r + h"', 3, "bad-perm", "names 'h'"),
    ('"r +"', 3, "bad-perm", "is not an expression of r and W"),
    ("[[0, 1], [1, 0]]", 3, "loop-world", "written for W=2, not W=3"),
    ("[1, 0]", 3, "loop-world", "written for W=2, not W=3"),
    ("[[0, -1]]", 2, "bad-perm", "is not a [source, destination] pair"),
    ("[[0, 999999999999]]", None, "bad-perm", "past the largest group dcpc checks"),
    ('"r % (W - W)"', 2, "bad-perm", "% 0, which has no value"),
    ('"W - 1 - r"', None, "loop-world", "depend on W"),
])
def test_bad_perms_are_located_errors(perm: str, world: int | None, code: str,
                                      words: str) -> None:
    text = ONE.replace("PERM", perm) + CREDIT
    found = _errors(text, world)
    assert [d.code for d in found] == [code], found
    (d,) = found
    line = text.splitlines()[7]
    assert (d.mark.file, d.mark.line, d.mark.col) == ("s.yaml", 8, line.index(perm) + 1)
    assert words in d.message, d.message


@pytest.mark.parametrize("extra,code", [(", offset: 2", "bad-perm"),
                                        (", wrap: false", "bad-perm")])
def test_a_perm_with_an_offset_or_wrap_is_refused(extra: str, code: str) -> None:
    text = ONE.replace("PERM", '"W - 1 - r"' + extra) + CREDIT
    found = _errors(text, 3)
    assert [d.code for d in found] == [code], found
    assert "both 'perm' and" in found[0].message


# --- the checker against the brute force and the execution oracle --------------------

@pytest.mark.parametrize("perm,worlds", [
    ('"W - 1 - r"', (2, 3, 4, 5)),  # mirror (a fixed point at odd W)
    ('"(r + W / 2) % W"', (2, 4)),  # half rotation
    ('"r + 1 - 2 * (r % 2)"', (2, 4)),  # swapped pairs
])
def test_a_perm_without_a_credit_races_and_with_one_is_proved(perm: str,
                                                              worlds: tuple) -> None:
    for world in worlds:
        racy, fixed = ONE.replace("PERM", perm), ONE.replace("PERM", perm) + CREDIT
        found = _findings(racy, world)
        exact = oracle_keys(parse_text(racy, world=world), world)
        assert ("race", "write-after-write", "y", "hop", "hop") in exact, world
        assert exact <= found, (world, exact - found)
        assert _findings(fixed, world) == set() == oracle_keys(parse_text(fixed, world=world),
                                                               world)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_checker_reports_every_race_the_exact_models_find_on_random_perms(
        data: st.DataObject) -> None:
    text = random_shift_schedule_text(data.draw, st, perm=True)
    for world in (2, 3, 4, 5):
        checker_covers(text, world)


def test_a_perm_store_is_checked_at_every_writer_of_its_table() -> None:
    """At W=3 the mirror's writer into rank 0 is rank 2, not rank 1: a race search that
    tried one writer per partition (right for an offset, which has one) took rank 1,
    whose next-shift chain orders it, and missed the race (found before the fix)."""
    text = HEAD + ("  - t0: {op: shift, src: x, dst: y, offset: next}\n"
                   '  - t1: {op: shift, src: x, dst: y, perm: "W - 1 - r"}\n')
    found, exact = checker_covers(text, 3)
    assert ("race", "write-after-write", "y", "t1", "t1") in exact & found


def test_the_conformance_files_check_clean() -> None:
    for world in range(2, 9):
        assert hb.check(parse_file(PERM, world), [world]).findings == [], world
        assert hb.check(parse_file(PARTIAL, world), [world]).findings == [], world
    assert hb.check(parse_file(PAIRS, 4), [4]).findings == []
    for world in (2, 3, 4, 5):
        assert oracle_keys(parse_file(PERM, world), world) == set()
        assert oracle_keys(parse_file(PARTIAL, world), world) == set()


# --- the float64 reference, the kernels, the runs ----------------------------------

def test_the_reference_moves_src_to_the_perm_rank_and_keeps_the_rest() -> None:
    text = ONE.replace("PERM", "[[0, 2], [2, 1], [1, 0]]").replace("[N, D]", "[N, 40]")
    text = text.replace("      - use:", "")
    schedule, world = parse_text(text, world=3), 3
    gen = torch.Generator().manual_seed(7)
    inputs = [{"x": simulate.as_stored(schedule, "x", torch.randn(4, 40, generator=gen,
                                                                  dtype=torch.float64))}
              for _ in range(world)]
    out = simulate.simulate_call(schedule, world, {"N": 4, "D": 40}, inputs,
                                 lambda step, rank, bufs: {"z": bufs["y"] * 1})
    for src, dst in ((0, 2), (2, 1), (1, 0)):
        assert torch.equal(out[dst]["y"], inputs[src]["x"])
    partial = parse_text(ONE.replace("PERM", '"r + 1"').replace("[N, D]", "[N, 40]"), world=3)
    out = simulate.simulate_call(partial, world, {"N": 4, "D": 40}, inputs,
                                 lambda step, rank, bufs: {"z": bufs["x"] * 1})
    assert "y" not in out[0]  # rank 0 is no destination: its y is left as it was
    assert torch.equal(out[2]["y"], inputs[1]["x"])


@pytest.mark.parametrize("path,world", [(PERM, 3), (PERM, 4), (PARTIAL, 3), (PAIRS, 4)],
                         ids=["mirror-3", "mirror-4", "partial-3", "pairs-4"])
def test_traced_kernels_store_into_the_perm_peer_only(path: Path, world: int) -> None:
    run = tr.run_traced(str(path), world, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems


# The host backend runs the two conformance files at W = 2, 3, 4 in
# tests/ops/test_op_schedules.py (every returned buffer compared on every rank in every
# call); here the torch backend, and the pairs file, which is no conformance file. Which
# ranks a perm leaves as they were is the float64 reference's (the counts below), the
# same whatever the backend.
@pytest.mark.e2e
@pytest.mark.parametrize("path,world,backend", [
    (PERM, 3, "torch"), (PARTIAL, 4, "torch"), (PAIRS, 4, "host"), (PAIRS, 4, "torch")])
def test_dcpc_run_of_a_perm_matches_float64(path: Path, world: int, backend: str) -> None:
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=4, seed=3)
    out = "kv_recv" if path == PERM else "recv"
    # the partial files return recv from both of their shifts
    assert report.outputs[out].compared == 4 * world * (1 if path == PERM else 2), text


def test_dcpc_check_names_the_w_a_pair_list_was_written_for(tmp_path: Path) -> None:
    path = tmp_path / "pairs.yaml"
    path.write_text(PAIRS.read_text())
    proc = subprocess.run([sys.executable, "-m", "dcpc", "check", str(path), "--world", "2..5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "written for W=4, not W=2" in proc.stdout + proc.stderr
    assert "[loop-world]" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


LOOP = HEAD + """\
  - ring:
      repeat: W - 1
      as: h
      steps:
        - hop:  {op: shift, src: x, dst: y, perm: "(r + h + 1) % W"}
        - use:  {op: external, reads: [y], writes: [z]}
        - done: {op: barrier}
"""


def test_a_perm_in_a_hop_loop_reads_the_hop_index() -> None:
    schedule = parse_text(LOOP, world=4)
    tables = [s.op.perm for s in schedule.step_list() if s.kind == "shift"]
    assert tables == [[1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]]
    for world in (2, 3, 4, 5):
        found, exact = checker_covers(LOOP, world)
        assert found == exact == set(), world
    racy = LOOP.replace("        - done: {op: barrier}\n", "")
    for world in (3, 4):
        found, exact = checker_covers(racy, world)
        assert ("race", "write-after-read", "y", "use_h0", "hop_h1") in exact, world


@pytest.mark.e2e
def test_dcpc_run_of_a_perm_in_a_hop_loop_matches_float64(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text(LOOP.replace("[N, D]", "[N, 40]"))
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend="host", calls=2,
                                    seed=3))
    assert report.launch.ok and report.mismatches == 0, format_report(report)


def test_a_read_of_a_partial_perm_s_dst_on_every_rank_is_read_before_write() -> None:
    text = ONE.replace("PERM", '"r + 1 - 2 * (r % 2)"') + CREDIT
    found = _errors(text, 3)  # rank 2 has no partner at W=3: its y is never written
    assert [d.code for d in found] == ["read-before-write"], found
    assert "has a perm in which some ranks are no destination" in found[0].message
    assert ("read-before-write", "", "y", "use", "") in oracle_unwritten(
        parse_text(text, world=3), 3)
    assert _errors(text, 4) == []  # at W=4 every rank has a partner


def test_a_perm_race_names_the_real_writer_where_it_races() -> None:
    """Rank 0's y is written by rank 2 under the mirror at W=3; the symmetric model
    also has phantom writers (rank 1, at the other delta): the counterexample names the
    real one, so `dcpc run --replay` delays ranks that really meet (it named rank 1)."""
    text = ONE.replace("PERM", '"W - 1 - r"')
    report = hb.check(parse_text(text, world=3), [3], hints=False)
    war = next(f for f in report.findings if f.cls == "write-after-read")
    assert "a perm's store from rank 2" in war.message, war.message


def test_a_race_only_a_phantom_writer_of_rank_0_makes_is_shown_at_a_real_one() -> None:
    """At W=3 the swap's table is [1, 0, -1]: rank 0's real writer (rank 1) waits for
    rank 0's credit, but rank 0's store into rank 1 waits for rank 2's. The race found
    on rank 0's instance comes from the phantom writer (rank 2 at delta +1, which sends
    nothing at W=3: it was named); it is shown rotated, rank 0 writing rank 1's y."""
    text = HEAD + ('  - swap: {op: shift, src: x, dst: y, perm: "r + 1 - 2 * (r % 2)"}\n'
                   '  - use: {op: external, when: "rank < 2", reads: [y], writes: [z]}\n'
                   "  - credit: {op: signal, to: next, channel: free}\n"
                   "  - freed: {op: wait, from: prev, channel: free}\n")
    found, exact = checker_covers(text, 3)
    assert ("race", "write-after-read", "y", "use", "swap") in exact & found
    table = [1, 0, -1]
    report = hb.check(parse_text(text, world=3), [3], hints=False)
    assert report.findings
    for f in report.findings:
        for loc in (f.first, f.second):
            if loc.step == "swap" and loc.access == "write":
                assert table[loc.rank] == loc.owner, f.message
                assert f"a perm's store from rank {loc.rank}" in f.message


# a perm's wait before its put, with a when: (the when checks pair its ranks' puts and
# waits by the table: dcpc.ops.common peers_of), on a perm with a cycle (0 <-> 1) whose
# ranks run it, the checker's deadlock (where only ranks 2, 3 ran it, the chain 2 -> 3 ends: no
# deadlock, as the brute force says, but races the ranks' real steps decide: see
# test_hb_cex_legal's RINGFIRST_NOB); the table is W = 4's alone
RING_FIRST = HEAD + """\
  - wr: {op: shift, src: x, dst: y, perm: PERM, when: "rank < 2", phase: wait}
  - pr: {op: shift, src: x, dst: y, perm: PERM, when: "rank < 2", phase: put}
  - use: {op: external, reads: [y], writes: [z]}
  - done: {op: barrier}
"""


@pytest.mark.parametrize("perm", ["[1, 0, 3, -1]", "[[0, 1], [1, 0], [2, 3]]"])
def test_a_fix_for_a_perm_list_is_searched_at_its_own_w(perm: str) -> None:
    """The hint search re-checked its candidate edits at W, W + 1 and the largest W, but
    a perm written as a list (or pairs) is one W's: at W = 5 `peers` indexed its table past
    its end and `dcpc check --world 4` died with an internal IndexError (found by review).
    A schedule unrolled for one W (``loop_world``) is searched at that W alone."""
    schedule = parse_text(RING_FIRST.replace("PERM", perm), "s.yaml", 4)
    report = hb.check(schedule, [4])
    assert [(f.kind, f.world) for f in report.findings] == [("deadlock", 4)], report.findings
