"""Rank-dependent steps (``when:``, dcpc.lang.when): the condition's grammar, its located
errors, the unroller putting the hop indices in, and the module's WHEN and runs()."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.schedules import diagnostics

from dcpc import pipeline
from dcpc.diagnostics import DiagnosticError
from dcpc.lang import expr as ex
from dcpc.lang.parse import parse_text

HEAD = """\
schedule: s
sizes: {N: 4, D: 2}
buffers:
  x: {shape: [N, D], dtype: f32}
  y: {shape: [N, D], dtype: f32}
  z: {shape: [N, D], dtype: f32}
  g: {shape: [N, D], dtype: f32, symmetric: true}
steps:
"""


@pytest.mark.parametrize(("text", "env", "want"), [
    ("h <= rank", {"h": 1, "rank": 1}, True),
    ("h + 1 <= rank", {"h": 1, "rank": 1}, False),
    ("rank % 2 == 0 and rank < W - 1", {"rank": 2, "W": 4}, True),
    ("rank % 2 == 0 and rank < W - 1", {"rank": 2, "W": 3}, False),
    ("not (rank == 0 or rank == W - 1)", {"rank": 0, "W": 3}, False),
    ("not rank == 0 or rank == W - 1", {"rank": 0, "W": 3}, False),
    ("((h < rank))", {"h": 0, "rank": 1}, True),
    ("(h + 1) % 2 == 0", {"h": 1}, True),
    ("(rank - 3) % 4 == 1", {"rank": 0}, True),  # Python's remainder: the divisor's sign
    ("2 * (h % 2) + 1 != rank", {"h": 3, "rank": 3}, False),
])
def test_conditions_parse_and_hold_as_written(text: str, env: dict, want: bool) -> None:
    cond = ex.parse_condition(text)
    assert ex.holds(cond, env) is want
    again = ex.parse_condition(ex.unparse(cond))  # the unroller writes them back as text
    assert again == cond


@pytest.mark.parametrize(("text", "words", "column"), [
    ("rank", "expected a comparison", 4),
    ("h < rank < W", "comparisons do not chain", 9),
    ("rank and h < 1", "expected a comparison", 5),
    ("h <= ", "expected a number", 4),
    ("h < not", "'not' joins conditions", 4),
    ("h << 2", "found '<'", 3),
    ("", "empty condition", 0),
    (3, "found a number", 0),
    ("(h < rank", "expected ')'", 9),
])
def test_what_is_not_a_condition_is_a_syntax_error_with_its_column(
        text: object, words: str, column: int) -> None:
    with pytest.raises(ex.ExprSyntaxError) as err:
        ex.parse_condition(text)
    assert words in str(err.value)
    assert err.value.column == column


def test_size_expressions_still_take_no_comparison_and_no_remainder() -> None:
    for text in ("N < 2", "N % 2"):
        with pytest.raises(ex.ExprSyntaxError, match="unexpected character"):
            ex.parse(text)


def _errors(steps: str, tmp_path: Path, worlds: list[int] | None = None) -> list:
    found = diagnostics(HEAD + steps, tmp_path, "s.yaml", worlds or [2, 3, 4])
    assert found, "refused"
    return found


@pytest.mark.parametrize(("when", "code", "words"), [
    ('"rank"', "bad-when", "expected a comparison"),
    ('"rank < W < 8"', "bad-when", "comparisons do not chain"),
    ('"rnk == 0"', "bad-when", "names 'rnk'"),
    ('"h == 0"', "bad-when", "names 'h'"),  # no loop around it: no hop index
    ('"rank % (W - W) == 0"', "bad-when", "has no value on rank 0, W=2: rank%(W-W) is 0 % 0"),
    ('"rank / 2 == 0"', "bad-when", "has no value on rank 1, W=2"),
    ("1", "wrong-type", ""),
])
def test_a_bad_condition_is_a_located_error(tmp_path: Path, when: str, code: str,
                                            words: str) -> None:
    found = [d for d in _errors(
        f"  - use: {{op: external, when: {when}, reads: [x, z], writes: [y]}}\n", tmp_path)
        if d.severity == "error"]
    assert [d.code for d in found] == [code], found
    assert words in found[0].message
    # at the condition itself: line 9 of the file, the value after 'when: '
    assert (found[0].mark.line, found[0].mark.col) == (9, 31), found[0].mark
    if code == "bad-when" and "rnk" in when:
        assert found[0].hint == "did you mean 'rank'?"


@pytest.mark.parametrize("step", [
    '{op: shift, src: x, dst: g, offset: next, when: "rank == 0"}',
    '{op: signal, channel: c, when: "rank == 0"}',
    '{op: all_gather, src: x, dst: g, dim: 0, when: "rank == 0"}',
])
def test_when_on_a_communication_step_is_refused(tmp_path: Path, step: str) -> None:
    text = f"  - talk: {step}\n"
    if "signal" in step:
        text += "  - listen: {op: wait, channel: c}\n"
    if "all_gather" in step:
        text = text.replace("g, dim", "h, dim")
    found = [d for d in _errors(text, tmp_path) if d.code == "when-on-communication"]
    assert found, text
    # the counterexample: the W, the two ranks of the edge, what hangs
    assert "at W=2 the condition differs between ranks 0 and 1" in found[0].message
    assert ("forever" in found[0].message) or ("left over" in found[0].message)
    assert "one value on every member of its team" in (found[0].hint or "")
    assert found[0].mark.line == 9


def test_the_unroller_puts_the_hop_indices_in(tmp_path: Path) -> None:
    text = HEAD + """\
  - ring:
      repeat: 3
      as: h
      steps:
        - use: {op: external, when: "h + 1 <= rank and rank < W", reads: [x], writes: [y]}
        - more:
            repeat: h
            as: g
            steps:
              - inner: {op: copy, when: "g - h < rank", src: x, dst: z}
"""
    schedule = parse_text(text)
    guards = {s.name: s.op.when for s in schedule.step_list()}
    assert guards == {
        "use_h0": "1 <= rank and rank < W", "use_h1": "2 <= rank and rank < W",
        "use_h2": "3 <= rank and rank < W",
        "inner_h1_0": "0-1 < rank", "inner_h2_0": "0-2 < rank", "inner_h2_1": "0-1 < rank",
    }


def test_the_module_says_which_steps_run_where(tmp_path: Path) -> None:
    """The module carries each guarded step's condition (WHEN) and its contract names
    the engine steps that run only where theirs holds; the method of a guarded kernel
    step returns without launching where ``runs`` is False."""
    path = tmp_path / "s.yaml"
    path.write_text(HEAD + """\
  - make: {op: external, when: "rank % 2 == 0", writes: [x]}
  - keep: {op: copy, when: "rank % 2 == 0", src: x, dst: y}
""")
    text = pipeline.run(path, pipeline.Options(worlds=[2, 3, 4]), until="emit").module_text
    assert '"make": ("==", ("%", ("sym", "rank"), ("num", 2)), ("num", 0)),' in text
    assert '"keep": ("==",' in text
    assert "only where rank%2 == 0" in text
    assert "        if not self.runs(_step):" in text
    namespace: dict = {}
    exec(compile(text, "s.py", "exec"), namespace)  # noqa: S102  (our own module's text)
    cls = namespace["S"]
    module = cls.__new__(cls)  # runs() reads the rank and W only: no group needed
    for rank, want in ((0, True), (1, False), (2, True)):
        module.rank, module.world = rank, 3
        assert module.runs("make") is want
        assert module.runs("keep") is want
    assert module.runs("nothing_guarded") is True


def test_a_range_whose_ranks_pass_the_bound_is_refused_at_once(tmp_path: Path) -> None:
    """Each W is decided rank by rank (no W stands for another): (guarded steps) x (ranks
    summed over the W asked) past MAX_RANK_CHECKS is schedule-too-large before any
    analysis, with the count and a narrower range to check."""
    from dcpc.lang.when import MAX_RANK_CHECKS

    steps = "".join(f'  - use{i}: {{op: external, when: "rank != {i}", reads: [x], '
                    f"writes: [y]}}\n" for i in range(4))
    path = tmp_path / "s.yaml"
    path.write_text(HEAD.replace("  g: {shape: [N, D], dtype: f32, symmetric: true}\n", "")
                    .replace("  z: {shape: [N, D], dtype: f32}\n", "") + steps)
    wide = list(range(2, 1025))
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(path, pipeline.Options(worlds=wide), until="hb")
    (found,) = err.value.diagnostics
    assert found.code == "schedule-too-large"
    assert f"{4 * sum(wide)} (step, rank) pairs" in found.message
    assert str(MAX_RANK_CHECKS) in found.message
    pipeline.run(path, pipeline.Options(worlds=list(range(2, 65))), until="hb")


def test_when_on_a_loop_guards_every_step_inside(tmp_path: Path) -> None:
    """A loop's when: is conjoined with the when: of every step inside it, nested loops
    included (their hop indices put in as for a step's own); a bad name in it is located
    at the loop's when: once, with the loop's own text (not per step or hop copy)."""
    steps = """\
  - ring:
      repeat: 2
      when: "rank == h"
      as: h
      steps:
        - use: {op: external, reads: [x], writes: [y]}
        - more:
            repeat: 2
            as: g
            when: "g < 1"
            steps:
              - inner: {op: copy, when: "rank < W", src: x, dst: z}
"""
    guards = {s.name: s.op.when for s in parse_text(HEAD + steps).step_list()}
    assert guards == {
        "use_h0": "rank == 0", "use_h1": "rank == 1",
        "inner_h0_0": "rank == 0 and 0 < 1 and rank < W",
        "inner_h0_1": "rank == 0 and 1 < 1 and rank < W",
        "inner_h1_0": "rank == 1 and 0 < 1 and rank < W",
        "inner_h1_1": "rank == 1 and 1 < 1 and rank < W",
    }
    found = [d for d in _errors(steps.replace('"rank == h"', '"rnk == h"'), tmp_path)
             if d.severity == "error"]
    (one,) = found
    assert (one.code, one.mark.line, one.mark.col) == ("bad-when", 11, 13), found
    assert "loop 'ring': when 'rnk == h' names 'rnk'" in one.message, found
    assert one.hint == "did you mean 'rank'?", found


@pytest.mark.parametrize("cond", ["7", "[rank]", '"rank <"'])
def test_a_loops_bad_when_is_refused_at_its_when(tmp_path: Path, cond: str) -> None:
    """A loop's when: that is no condition (not a string, a syntax error) is refused once,
    at the loop's when:, also where the step inside has a when: of its own (which the
    conjunction dropped a non-string guard of)."""
    found = _errors(f"""\
  - ring:
      repeat: 2
      as: h
      when: {cond}
      steps:
        - use: {{op: external, when: "rank > 0", reads: [x], writes: [y]}}
""", tmp_path)
    found = [d for d in found if d.severity == "error"]
    (one,) = found
    assert (one.code, one.mark.line, one.mark.col) == ("bad-when", 12, 13), found
    assert one.message.startswith("loop 'ring': when"), found


def test_a_remainder_by_zero_in_a_loop_is_a_located_error(tmp_path: Path) -> None:
    """The unroller folds the hop's constants; one that has no value (h % 0, h / 2 at an
    odd hop) is left for the checker, which says where: never a traceback."""
    found = _errors("""\
  - ring:
      repeat: 2
      as: h
      steps:
        - use: {op: external, when: "h % (h - h) == 0", reads: [x], writes: [y]}
""", tmp_path)
    found = [d for d in found if d.severity == "error"]
    assert {d.code for d in found} == {"bad-when"}, found
    assert "0 % 0, which has no value" in found[0].message
    assert found[0].mark.line == 13
