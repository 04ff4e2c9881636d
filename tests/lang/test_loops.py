"""Hop loops (``repeat``, dcpc.lang.loops): the unrolling and buffer slices, their located
errors, the per-W claim, and the checker against the brute force (tests/support/hb_oracle.py)
and the execution oracle on random loop schedules at W = 2, 3, 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import disagreements
from support.hb_oracle import (
    assert_brute_force_agrees,
    random_loop_schedule_text,
    unrolled,
)

from dcpc import pipeline
from dcpc.check import hb, structural
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
RING = ROOT / "schedules" / "gallery" / "ring_attention.yaml"
# the line of the gallery ring's trip count (`repeat: W - 2`), where its W-naming is reported
RING_LOOP_LINE = next(i for i, line in enumerate(RING.read_text().splitlines(), 1)
                      if line.strip() == "repeat: W - 2")
HEAD = """\
schedule: s
sizes: {N: 4, D: 2, P: 3}
buffers:
  x: {shape: [N, D], dtype: f32}
  y: {shape: [N, D], dtype: f32}
  kv: {shape: [2, N, D], dtype: f32, symmetric: true}
steps:
  - init: {op: external, reads: [x], writes: ["kv[0]"]}
  - ring:
      repeat: REPEAT
      as: h
      steps:
        - send: {op: shift, src: "kv[h % 2]", dst: "kv[(h + 1) % 2]", phase: put}
        - use: {op: external, reads: ["kv[h % 2]"], writes: [y]}
        - recv: {op: shift, src: "kv[h % 2]", dst: "kv[(h + 1) % 2]", phase: wait}
"""


def _text(repeat: str = "W - 1", **swap: str) -> str:
    text = HEAD.replace("REPEAT", repeat)
    for old, new in swap.items():
        text = text.replace(old.replace("_", " "), new)
    return text


def _error(text: str, world: int | None = 3) -> list:
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", world)
    return err.value.diagnostics


def test_hops_unroll_in_order_with_their_slices() -> None:
    schedule = parse_text(_text(), "s.yaml", 4)
    names = [s.name for s in schedule.step_list()]
    assert names == ["init"] + [f"{s}_h{h}" for h in range(3) for s in ("send", "use", "recv")]
    sends = [s.op for s in schedule.step_list() if s.name.startswith("send")]
    assert [(op.src, op.dst) for op in sends] == [("kv_0", "kv_1"), ("kv_1", "kv_0"),
                                                  ("kv_0", "kv_1")]
    assert "kv" not in schedule.buffers
    assert [schedule.buffers[f"kv_{i}"].shape for i in (0, 1)] == [["N", "D"]] * 2
    assert schedule.buffers["kv_1"].is_symmetric and schedule.loop_world == 4
    # an unrolled step's errors point into the loop body (line 13, the 'send' key)
    send = schedule.step_list()[1]
    assert (send.mark().line, send.mark().col) == (13, 11)


def test_a_constant_trip_count_needs_no_world() -> None:
    schedule = parse_text(_text("P - 1"), "s.yaml")
    assert len(schedule.step_list()) == 1 + 2 * 3 and schedule.loop_world is None


@pytest.mark.parametrize("swap,code,line,words", [
    ({"h % 2]": "h % (W + 1)]"}, "bad-index", 13,
     "must be an integer constant or one name (W, an integer size); here it is '(W + 1)'"),
    ({"(h + 1) % 2": "h + 2"}, "bad-index", 13, "slice 2 of 'kv'"),
    ({"(h + 1) % 2": "q"}, "bad-index", 13, "names 'q'"),
    ({"writes: [y]}": "writes: [kv]}"}, "mixed-index", 14, "used whole here and by slice"),
    ({"as: h": "as: H"}, "bad-loop", 11, "'as: <hop index name>'"),
    ({"as: h": "as: h\n      times: 2"}, "unknown-key", 12, "unknown key 'times'"),
])
def test_bad_loops_are_located_errors(swap: dict, code: str, line: int, words: str) -> None:
    found = _error(_text(**{k.replace(" ", "_"): v for k, v in swap.items()}))
    assert {d.code for d in found} == {code}, found  # once per place (send and recv)
    assert found[0].mark.file == "s.yaml" and found[0].mark.line == line, found[0]
    assert words in found[0].message, found[0].message


def test_a_nested_loop_unrolls_inside_its_hop() -> None:
    """Loops nest (issue 33 item 3): the inner loop's steps of hop (h, g) are named
    '<step>_h<h>_<g>' and come after hop h's steps before it; a single loop's names
    are unchanged."""
    text = _text() + "        - inner: {repeat: 2, as: g, steps: [{z: {op: barrier}}]}\n"
    names = [s.name for s in parse_text(text, "s.yaml", 3).step_list()]
    hop = ["send", "use", "recv"]
    assert names == (["init"] + [f"{s}_h0" for s in hop] + ["z_h0_0", "z_h0_1"]
                     + [f"{s}_h1" for s in hop] + ["z_h1_0", "z_h1_1"])


def test_a_trip_count_naming_w_needs_a_world() -> None:
    found = _error(_text(), world=None)
    assert [d.code for d in found] == ["loop-world"]
    assert (found[0].mark.line, found[0].mark.col) == (10, 15)  # the value of 'repeat'


def test_a_loop_past_the_step_bound_is_loop_too_long() -> None:
    from dcpc.lang.loops import MAX_STEPS

    hops = MAX_STEPS // 3  # the longest loop: 170 hops x 3 steps = 510 steps at 512
    parse_text(_text(), "s.yaml", hops + 1)  # with init: 511 steps, analysed
    found = _error(_text(), world=hops + 2)
    assert [d.code for d in found] == ["loop-too-long"], found
    assert (found[0].mark.line, found[0].mark.col) == (10, 15)
    assert f"{hops + 1} hops x 3 steps = {3 * hops + 3} steps (at W={hops + 2})" in (
        found[0].message)
    pre = MAX_STEPS - 3 * hops  # steps before the loop that pass the bound with init's
    assert pre >= 1
    found = _error(_text().replace('  - ring:', '  - pre: {op: barrier}\n' * pre + '  - ring:'),
                   world=hops + 1)
    assert [d.code for d in found] == ["loop-too-long"], found
    assert (found[0].mark.line, found[0].mark.col) == (10 + pre, 15)
    assert f"the schedule has {MAX_STEPS + 1} steps (at W={hops + 1})" in found[0].message


def test_several_worlds_are_checked_one_by_one_and_compiled_into_one_module(tmp_path) -> None:
    path = tmp_path / "s.yaml"
    # the barrier after each hop's wait: the next push into a slice only once every rank's
    # wait returned it (before the wait it was a race: the push is in flight until it)
    path.write_text(_text().replace('phase: wait}', 'phase: wait}\n        - done: {op: barrier}'))
    c = pipeline.run(path, pipeline.Options(worlds=[2, 3, 4]), until="hb")
    assert c.per_world == [2, 3, 4]
    both = pipeline.run(path, pipeline.Options(worlds=[2, 3]), until="emit").module_text
    assert "    LOOP_WORLDS = {\n        2: _S_W2,\n        3: _S_W3,\n    }\n" in both
    one = pipeline.run(path, pipeline.Options(worlds=[3]), until="emit")
    assert "LOOP_WORLD = 3" in one.module_text and "LOOP_WORLDS" not in one.module_text
    # a race at one W only is found: W=2 has one hop, so no hop's put meets a read (the
    # last barrier keeps the next call's push after this call's wait)
    bad = tmp_path / "bad.yaml"
    bad.write_text(_text() + "  - last: {op: barrier}\n")
    pipeline.run(bad, pipeline.Options(worlds=[2]), until="hb")
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(bad, pipeline.Options(worlds=[2, 3]), until="hb")
    assert any(d.code == "race" and "W=3" in d.message for d in err.value.diagnostics)


def _loop_schedules(data: st.DataObject):
    text = random_loop_schedule_text(data.draw, st)
    for world, schedule in unrolled(text):
        yield text, world, schedule


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_and_brute_force_agree_on_random_loop_schedules(data: st.DataObject) -> None:
    for text, world, schedule in _loop_schedules(data):
        assert_brute_force_agrees(schedule, world, text)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_and_execution_oracle_agree_on_random_loop_schedules(
        data: st.DataObject) -> None:
    for text, world, schedule in _loop_schedules(data):
        assert disagreements(schedule, [world]) == [], (text, world)


def test_an_index_naming_w_outside_a_loop_makes_the_schedule_per_w() -> None:
    text = _text("2").replace('writes: ["kv[0]"]', 'writes: ["kv[(W - 1) % 2]"]')
    assert parse_text(text, "s.yaml", 3).step_list()[0].op.writes == ["kv_0"]
    assert parse_text(text, "s.yaml", 2).step_list()[0].op.writes == ["kv_1"]
    assert parse_text(text, "s.yaml", 2).loop_world == 2
    found = _error(text, world=None)
    assert [d.code for d in found] == ["loop-world"] and "names W" in found[0].message
    assert (found[0].mark.line, found[0].mark.col) == (8, 46)  # the value of writes


def test_a_module_unrolled_for_one_w_refuses_another(tmp_path) -> None:
    from dcpc.harness.worker import load_module_class

    path = tmp_path / "s.yaml"
    # the barrier after each hop's wait: the next push into a slice only once every rank's
    # wait returned it (before the wait it was a race: the push is in flight until it)
    path.write_text(_text().replace('phase: wait}', 'phase: wait}\n        - done: {op: barrier}'))
    module = tmp_path / "s.py"
    module.write_text(pipeline.run(path, pipeline.Options(worlds=[3])).module_text)
    cls = load_module_class(str(module), "s")
    with pytest.raises(ValueError, match="unrolled for W=3.*group has 1 ranks"):
        cls(None, sizes={}, device="cpu", backend="torch")


def test_the_ring_without_its_hop_credit_is_refused_from_w4_on_only() -> None:
    """The claim is per W: the race needs two hops of the loop (W >= 4), so a check of
    W = 2..3 passes and says so, and one that includes 4 finds it."""
    twin = ROOT / "tests" / "gallery_twins" / "ring_attention.no_hop_credit.yaml"
    c = pipeline.run(twin, pipeline.Options(worlds=[2, 3]), until="hb")
    assert c.per_world == [2, 3] and c.hb_report.findings == []
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(twin, pipeline.Options(worlds=[2, 3, 4]), until="hb")
    found = [d for d in err.value.diagnostics if d.severity == "error"]
    assert {d.code for d in found} == {"race"}
    assert all("(W=4)" in d.message for d in found), found


@pytest.mark.parametrize("steps,code", [
    ('"a[1]"', "wrong-type"),
    ("\n  - r: {repeat: 2, as: h, steps: [{a: 3}]}", "bad-step"),
    ("\n  - r: {repeat: 2, as: h, steps: 5}", "bad-loop"),
    ("\n  - r: {repeat: true, as: h, steps: [{a: {op: barrier}}]}", "bad-repeat"),
    ('\n  - r: {repeat: "2 -", as: h, steps: [{a: {op: barrier}}]}', "bad-repeat"),
    ('\n  - r: {repeat: "T", as: h, steps: [{a: {op: barrier}}]}', "bad-repeat"),
    ('\n  - a: {op: copy, src: "x[0]", dst: y}', "bad-index"),
    ('\n  - a: {op: copy, src: "y[1 % 0]", dst: "y[0]"}', "bad-index"),
])
def test_malformed_loops_and_indices_are_errors_not_tracebacks(steps: str, code: str) -> None:
    text = ("schedule: s\nsizes: {T: {max: 4}}\nbuffers:\n  x: {shape: [2], dtype: f32}\n"
            "  y: {shape: [2, 3], dtype: f32}\nsteps: " + steps + "\n")
    assert [d.code for d in _error(text)] == [code]


def test_a_range_past_the_step_bound_is_refused_before_any_w_is_analysed(monkeypatch) -> None:
    """Issue 22 item 9: ring_attention at --world 2..1024 walked W = 2..42 (each
    unrolled and analysed) before refusing W = 43 (the bound was 256 steps; at 512 it is
    W = 86, 516 steps). The trip counts say which W passes the bound, so it is refused
    before any W reaches the structural or the HB check."""
    from dcpc.lang import loops, yamlsrc

    ring = ROOT / "schedules" / "gallery" / "ring_attention.yaml"
    data = yamlsrc.load(ring.read_text(), str(ring))
    # the first W past the bound (86 at 512 steps; the W before it parses within it)
    first = next(w for w in range(2, 1025) if loops.unrolled_length(data, w) > loops.MAX_STEPS)
    length = loops.unrolled_length(data, first)
    assert len(parse_text(ring.read_text(), str(ring), first - 1).step_list()) <= loops.MAX_STEPS

    seen: dict[str, list[int]] = {"structural": [], "hb": [], "unrolled": []}
    real = structural.check, hb.check, loops.expand

    def counted(key: str, fn):
        def spy(*args, **kwargs):
            seen[key].append(args[1] if key != "unrolled" else args[2])  # the W(s)
            return fn(*args, **kwargs)
        return spy

    monkeypatch.setattr(structural, "check", counted("structural", real[0]))
    monkeypatch.setattr(hb, "check", counted("hb", real[1]))
    monkeypatch.setattr(loops, "expand", counted("unrolled", real[2]))
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(ring, pipeline.Options(worlds=list(range(2, 1025))), until="hb")
    found = err.value.diagnostics
    assert [d.code for d in found] == ["loop-too-long"], found
    assert f"{length} steps (at W={first})" in found[0].message, found[0].message
    assert found[0].mark.line == RING_LOOP_LINE
    assert seen == {"structural": [], "hb": [], "unrolled": [first]}
    # a range inside the bound is still analysed at every W, each W on its own
    pipeline.run(ring, pipeline.Options(worlds=[2, 3]), until="hb")
    assert seen["structural"] == [[2], [3]] and seen["hb"] == [[2], [3]]


def test_the_unrolled_length_from_the_trip_counts_is_the_unrolled_schedule_s() -> None:
    from dcpc.lang import loops, yamlsrc

    texts = [_text(), _text("P - 1"), _text("W * 2 - 3"),
             _text().replace("  - ring:", "  - pre: {op: barrier}\n  - ring:")]
    for text in texts:
        for world in (2, 3, 7, 40):
            length = loops.unrolled_length(yamlsrc.load(text, "s.yaml"), world)
            assert length == len(parse_text(text, "s.yaml", world).step_list()), (text, world)
    too_long = [loops.first_too_long(yamlsrc.load(t, "s.yaml"), list(range(2, 1025)))
                for t in texts]
    # the first W whose steps (init, 3 per hop, the barrier before) pass the bound
    steps = [lambda w: 1 + 3 * (w - 1), None, lambda w: 1 + 3 * (2 * w - 3),
             lambda w: 2 + 3 * (w - 1)]
    assert too_long == [None if f is None else next(w for w in range(2, 1025)
                                                    if f(w) > loops.MAX_STEPS)
                        for f in steps]
    assert too_long[0] > 100  # 172 at 512 steps (87 at 256)


def test_a_range_whose_w_together_pass_the_budget_is_refused_at_once(monkeypatch) -> None:
    """Issue 22 item 9: every W of a per-W file is unrolled and analysed on its own;
    ring_attention at 2..42 (each W within the step bound of 256) took 6 s. Past
    MAX_TOTAL_STEPS (12 x the step bound) unrolled steps in all, the check is refused
    before any W is analysed, naming the widest range that fits; that range is still
    checked."""
    from dcpc.lang import loops, yamlsrc

    seen: list[list[int]] = []
    real = hb.check

    def spy(*args, **kwargs):
        seen.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(hb, "check", spy)
    ring = ROOT / "schedules" / "gallery" / "ring_attention.yaml"
    data = yamlsrc.load(ring.read_text(), str(ring))
    # every W of the range within the step bound (2..85 at 512), together past the budget
    worlds = list(range(2, loops.first_too_long(data, list(range(2, 1025)))))
    total = sum(loops.unrolled_length(data, w) for w in worlds)
    assert total > loops.MAX_TOTAL_STEPS
    fits = max(w for w in worlds if sum(loops.unrolled_length(data, v)
                                        for v in range(2, w + 1)) <= loops.MAX_TOTAL_STEPS)
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(ring, pipeline.Options(worlds=worlds), until="hb")
    found = err.value.diagnostics
    assert [d.code for d in found] == ["schedule-too-large"], found
    assert f"{total} unrolled steps" in found[0].message
    assert f"check W 2..{fits}" in found[0].message and found[0].mark.line == RING_LOOP_LINE
    assert seen == []
    pipeline.run(ring, pipeline.Options(worlds=list(range(2, fits + 1))), until="hb")
    assert seen == [[w] for w in range(2, fits + 1)]


@pytest.mark.parametrize("asked", ["4,8", "2,4..6,8", "5..7"])
def test_the_cli_names_exactly_the_worlds_a_per_w_file_was_checked_for(asked: str) -> None:
    """A file whose trip count names W is unrolled and checked once per W of --world:
    the report names exactly those W (an old text said 'each W of W 4..8' for 4,8)."""
    from click.testing import CliRunner

    from dcpc.cli import main
    from dcpc.worlds import parse_worlds

    ring = str(ROOT / "schedules" / "gallery" / "ring_attention.yaml")
    got = CliRunner().invoke(main, ["check", ring, "--world", asked], catch_exceptions=False)
    assert got.exit_code == 0, got.output
    head, claim = got.output.splitlines()[:2]
    span = head.split(": ok (W", 1)[1].split(",  ")[0].split(", ")[0].lstrip("= ")
    assert parse_worlds(span) == parse_worlds(asked), got.output
    assert claim.strip().startswith(
        "a trip count, an index, an offset, an interleave or a "
        f"perm names W (first at line {RING_LOOP_LINE}): each of W"), claim
    said = claim.split("each of W", 1)[1].split(" was unrolled")[0].lstrip("= ")
    assert parse_worlds(said) == parse_worlds(asked), claim
    assert "no claim for any other W" in claim
    js = CliRunner().invoke(main, ["check", ring, "--world", asked, "--format", "json"])
    assert json.loads(js.output)["results"][0]["worlds"] == parse_worlds(asked)


def _one_ring_line(index: str) -> str:
    return ("schedule: s\nsizes: {N: 4, D: 2}\nbuffers:\n  x: {shape: [N, D], dtype: f32}\n"
            "  kv: {shape: [2, 2, N, D], dtype: f32}\n"
            "steps:\n  - ring:\n      repeat: 2\n      as: h\n      steps:\n"
            f'        - use: {{op: external, reads: ["kv{index}"], writes: [x]}}\n')


def test_an_index_with_two_subscripts_is_refused_with_a_hint_that_is_accepted() -> None:
    """'k_recv[h % 2][0]' (issue 33 item 2): one index per name; the hint says exactly
    what to declare and write instead, and what it says parses to the same slices."""
    found = _error(_one_ring_line("[h % 2][1]"))
    assert [d.code for d in found] == ["bad-index"], found
    assert (found[0].mark.line, found[0].mark.col) == (11, 38)  # the reads list
    assert "more than one index" in found[0].message
    assert found[0].hint == ("declare its two leading axes as one of 2 x 2 = 4 slices "
                             "('shape: [4, N, D]') and write 'kv[2 * (h % 2) + 1]'")
    fixed = (_one_ring_line("[2 * (h % 2) + 1]")
             .replace("[2, 2, N, D]", "[4, N, D]"))
    reads = [s.op.reads[0] for s in parse_text(fixed, "s.yaml", 2).step_list()]
    assert reads == ["kv_1", "kv_3"]  # [h % 2][1] at h = 0, 1


@pytest.mark.parametrize("index,slices", [
    ("2 * (h % 2) + 1", [1, 3, 1]),
    ("(h % 2) + 2", [2, 3, 2]),
    ("2 * ((h + 1) % 2) + (h % 2)", [2, 1, 2]),
    ("(2 * h + 3) % 4", [3, 1, 3]),
    ("h % 2 % 4", [0, 1, 0]),
    ("((h % 3) + 1) % 4", [1, 2, 3]),
])
def test_a_remainder_in_parentheses_is_part_of_a_larger_index(index: str, slices) -> None:
    text = (_one_ring_line(f"[{index}]").replace("[2, 2, N, D]", "[4, N, D]")
            .replace("repeat: 2", "repeat: 3"))
    reads = [s.op.reads[0] for s in parse_text(text, "s.yaml", 2).step_list()]
    assert reads == [f"kv_{i}" for i in slices]


@pytest.mark.parametrize("index,words", [
    ("h % 2 + 1", "here it is '2 + 1': write '(h % 2) + 1' to take the remainder first"),
    ("h % (W + 1)", "must be an integer constant or one name (W, an integer size); "
     "here it is '(W + 1)'"),
    ("(h % M) + 1", "here it is 'M'"),
    ("2 * (h % 0)", "'% 0' divides by zero"),
])
def test_a_remainder_that_is_not_accepted_says_what_is(index: str, words: str) -> None:
    text = _one_ring_line(f"[{index}]").replace("[2, 2, N, D]", "[4, N, D]")
    found = _error(text)
    assert [d.code for d in found] == ["bad-index"], found
    assert (found[0].mark.line, found[0].mark.col) == (11, 38)  # the reads list
    assert words in found[0].message, found[0].message
    assert "takes an integer constant such as 2" not in found[0].message
    assert "'2 * (h % 2) + 1'" in found[0].hint


def test_an_index_naming_w_inside_parentheses_makes_the_schedule_per_w(tmp_path) -> None:
    text = (_one_ring_line("[2 * ((W + h) % 2) + 1]").replace("[2, 2, N, D]", "[4, N, D]"))
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert pipeline.run(path, pipeline.Options(worlds=[2, 3]), until="check").per_world == [2, 3]
    two = [s.op.reads[0] for s in parse_text(text, "s.yaml", 2).step_list()]
    three = [s.op.reads[0] for s in parse_text(text, "s.yaml", 3).step_list()]
    assert (two, three) == (["kv_1", "kv_3"], ["kv_3", "kv_1"])


@pytest.mark.e2e
def test_a_ring_indexed_through_a_remainder_in_parentheses_checks_and_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """schedules/ops/shift_ring.yaml with its two receive buffers as slices 1 and 3 of
    four ('recv[2 * (h % 2) + 1]'): checked at W = 2..4 and run on CPU at W = 3."""
    from dcpc.demo import main as run_main

    text = (ROOT / "schedules" / "ops" / "shift_ring.yaml").read_text()
    swaps = {"recv: {shape: [2, N, D]": "recv: {shape: [4, N, D]",
             '"recv[0]"': '"recv[1]"',
             '"recv[h % 2]"': '"recv[2 * (h % 2) + 1]"',
             '"recv[(h + 1) % 2]"': '"recv[2 * ((h + 1) % 2) + 1]"',
             '"recv[(W - 2) % 2]"': '"recv[2 * ((W - 2) % 2) + 1]"'}
    for old, new in swaps.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "ring4.yaml"
    path.write_text(text)
    c = pipeline.run(path, pipeline.Options(worlds=[2, 3, 4]), until="hb")
    assert c.per_world == [2, 3, 4] and c.warnings == []
    assert sorted(n for n in c.schedule.buffers if n.startswith("recv")) == [
        f"recv_{i}" for i in range(4)]
    code = run_main([str(path), "--world", "3", "--backend", "local", "--calls", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "OK: every output matches (0 mismatches)" in out, out


BODY_ONLY = """\
schedule: s
sizes: {N: 4}
buffers:
  a: {shape: [N], dtype: f32}
  tmp: {shape: [N], dtype: f32}
  b: {shape: [N], dtype: f32}
  z: {shape: [N], dtype: f32}
steps:
  - first: {op: external, reads: [a], writes: [b]}
  - opened: {op: signal, to: next, channel: c}
  - ring:
      repeat: W - 2
      as: h
      steps:
        - polled: {op: wait, from: prev, channel: c}
        - use: {op: external, reads: [a], writes: [tmp]}
        - used: {op: external, reads: [tmp], writes: [b]}
"""


def test_a_per_w_file_s_warnings_are_judged_over_every_w_checked(tmp_path) -> None:
    """Issue 33 item 6: a buffer that only a loop's body uses is unused at W=2 (no hop);
    used at another W checked, that is no warning (--strict passes). A warning of some W
    only names them (W=2's unmatched signal was dropped: only the last W's warnings were
    kept). One of every W is reported once, as it is."""
    path = tmp_path / "s.yaml"
    path.write_text(BODY_ONLY)
    c = pipeline.run(path, pipeline.Options(worlds=[2, 3]), until="hb")
    found = sorted(c.warnings, key=lambda d: d.code)
    assert [d.code for d in found] == ["unmatched-signal", "unused-buffer"], found
    assert found[0].message.endswith("(at W 2 of the W checked, 2..3)"), found[0].message
    assert found[1].message == "buffer 'z' is not used by any step"  # at every W
    path.write_text("".join(line + "\n" for line in BODY_ONLY.splitlines()
                            if not line.startswith(("  z:", "  - opened:", "        - polled:"))))
    strict = pipeline.run(path, pipeline.Options(worlds=[2, 3], strict=True), until="hb")
    assert strict.warnings == []
    alone = pipeline.run(path, pipeline.Options(worlds=[2]), until="hb")  # one W: its own
    assert [d.code for d in alone.warnings] == ["unused-buffer"]
