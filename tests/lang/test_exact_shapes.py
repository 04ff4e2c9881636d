"""Shape questions decided exactly over whole size ranges (dcpc/lang/exact.py,
dcpc/lang/questions.py; issue 22 item 8). Each case below was accepted when the
checker sampled T at 1, 2, 3, max/2, max-1, max."""

from __future__ import annotations

import random

import pytest

from dcpc.check import check
from dcpc.diagnostics import Diagnostic
from dcpc.lang import expr as ex
from dcpc.lang.parse import parse_text
from dcpc.lang.sizes import size_table

GATHER = """\
schedule: sq
sizes:
  T: {{max: 16}}
  H: {{multiple_of: W}}
  D: 576
buffers:
  a: {{shape: ["{src}", 4], dtype: f32}}
  b: {{shape: ["{dst}", 4], dtype: f32, symmetric: true}}
steps:
  - g: {{op: all_gather, src: a, dst: b}}
  - e: {{op: external, reads: [b]}}
  - r: {{op: barrier}}
"""
# a polynomial that is zero at every T the old sampler tried for max 16
ZERO_AT_SAMPLES = "(T-1)*(T-2)*(T-3)*(T-8)*(T-15)*(T-16)"


def found(src: str, dst: str, worlds: range = range(2, 5)) -> list[Diagnostic]:
    schedule = parse_text(GATHER.format(src=src, dst=dst), "t.yaml")
    return [d for d in check(schedule, list(worlds)) if d.severity == "error"]


def test_square_zero_between_samples_is_a_nonpositive_dim() -> None:
    out = found("(T-11)*(T-11)", "W*(T-11)*(T-11)", range(2, 73))
    assert [d.code for d in out] == ["nonpositive-dim", "nonpositive-dim"]
    assert "is 0 for W=2 (T=11)" in out[0].message
    assert (out[0].mark.line, out[0].mark.col) == (7, 15)


def test_rows_that_match_only_at_the_sampled_sizes_are_a_mismatch() -> None:
    square = f"{ZERO_AT_SAMPLES}*{ZERO_AT_SAMPLES}"
    out = found("T", f"W*({square}+T)")
    assert [d.code for d in out] == ["shape-mismatch"]
    assert "they differ for W=2 (T=4)" in out[0].message


@pytest.mark.parametrize("src,dst", [
    ("T", "W*T"), ("T", "T*W"), ("H/W", "H"), ("T*(T+1)/2", "W*(T*T+T)/2"),
    ("(T-3)*(T-3)+1", "W*(T*T-6*T+10)"), ("D/2", "288*W"), ("(H/W)*(H/W)", "H*H/W"),
])
def test_equal_everywhere_is_accepted(src: str, dst: str) -> None:
    assert found(src, dst, range(2, 65)) == []


@pytest.mark.parametrize("src,where", [
    ("T*(T+2)/2", "T=1"), ("T/2", "T=1"), ("(T-16)*(T-16)", "T=16"), ("T-W", "T=1"),
    ("(W-3)*T", None),
])
def test_a_single_failing_binding_is_found(src: str, where: str | None) -> None:
    out = found(src, f"W*({src})")
    assert out, src
    assert out[0].code in ("inexact-division", "nonpositive-dim")
    if where:
        assert f"({where})" in out[0].message


def test_what_cannot_be_decided_is_refused_with_its_place() -> None:
    text = GATHER.format(src="T", dst="W*T").replace(
        "  D: 576\n", "  D: 576\n  A: {max: 65536}\n  B: {max: 65536}\n").replace(
        "  b: {shape", '  c: {shape: ["(A-B)*(A-B)+1"], dtype: f32}\n  b: {shape').replace(
        "reads: [b]", "reads: [b], writes: [c]")
    out = [d for d in check(parse_text(text, "t.yaml"), [2, 3]) if d.severity == "error"]
    assert [d.code for d in out] == ["shape-undecided"]
    assert (out[0].mark.line, out[0].mark.col) == (10, 15)


def test_random_polynomials_agree_with_brute_force() -> None:
    """Every answer matches evaluating every binding (T 1..12, W 2..5)."""
    from dcpc.lang.questions import Samples  # the exact questions (new in issue 22)

    rng = random.Random(22)
    table = size_table(parse_text(GATHER.format(src="T", dst="W*T").replace(
        "T: {max: 16}", "T: {max: 12}"), "t.yaml"))
    worlds = [2, 3, 4, 5]
    samples = Samples(table, worlds)
    atoms = ["T", "W", "1", "2", "3", "(T-5)", "(W-3)", "(T-W)"]

    def random_expr(depth: int) -> str:
        if depth == 0:
            return rng.choice(atoms)
        op = rng.choice("+-*")
        return f"({random_expr(depth - 1)}{op}{random_expr(depth - 1)})"

    for _ in range(150):
        a, b = ex.parse(random_expr(2)), ex.parse(random_expr(2))
        envs = [{"W": w, "T": t, "D": 576, "H": w} for w in worlds for t in range(1, 13)]
        truly_nonpositive = any(ex.evaluate(a, env) <= 0 for env in envs)
        assert (samples.nonpositive(a) is not None) == truly_nonpositive, ex.unparse(a)
        differ = any(ex.evaluate(a, env) != ex.evaluate(b, env) for env in envs)
        assert (samples.shapes_differ([a], [b]) is not None) == differ
        half = ("/", a, ("num", 2))
        inexact = any(ex.evaluate(a, env) % 2 for env in envs)
        assert (samples.inexact(half) is not None) == inexact, ex.unparse(half)


def test_run_time_sizes_that_give_no_shape_name_the_argument_and_dimension() -> None:
    """A call binds T from 'a' ([T]); b's dimension T/2 is not whole for T=3, and
    T-4 is negative: a DcpcArgumentError naming 'b' and dimension 0, not a raw error."""
    import torch

    from dcpc.runtime.errors import DcpcArgumentError
    from dcpc.runtime.validate import Signature

    for dim, want in (("T/2", "T/2 is 3/2"), ("T-4", "(T-4) is -1 for T=3")):
        sig = Signature("step", [("a", (ex.parse("T"),), "f32"), ("b", (ex.parse(dim),), "f32")],
                        {"W": 2}, {"T": 16}, torch.device("cpu"))
        with pytest.raises(DcpcArgumentError) as info:
            sig.bind([torch.zeros(3), torch.zeros(1)], {"W": 2})
        assert "step(): dimension 0 of argument 'b'" in str(info.value), str(info.value)
        assert want in str(info.value), str(info.value)
        assert "T=3" in str(info.value)


@pytest.mark.parametrize("text", ["-D", "-D * 2", "-r % W", "-(r + 1) % W", "(-D) - 1",
                                  "-2 + D", "3 * (-D + 1)", "-(-D)"])
def test_a_leading_minus_reads_as_python_does(text: str) -> None:
    """A leading minus (at the start of an expression or after '(') negates the atom
    after it, as tight as Python's unary minus: the same value as Python's, and the
    tree's printed form reads back to the same tree."""
    env = {"D": 3, "r": 1, "W": 4}
    tree = ex.parse(text, modulo=True)
    assert ex.evaluate(tree, env) == eval(text, {}, dict(env))  # noqa: S307 - our own texts
    assert ex.parse(ex.unparse(tree), modulo=True) == tree


@pytest.mark.parametrize("text,column", [("--", 1), ("- -D", 2), ("-", 1), ("2 - -D", 4),
                                         ("2 * -D", 4), ("(--D)", 2)])
def test_more_than_a_leading_minus_is_a_located_syntax_error(text: str, column: int) -> None:
    with pytest.raises(ex.ExprSyntaxError) as err:
        ex.parse(text)
    assert err.value.column == column and "expected a number" in str(err.value)


def _spent(buffers: int) -> str:
    """``buffers`` squares of two sizes of max 100 (each spends about 10,000 of the check's
    50,000 evaluations), then a cast by 128 channels and a split whose questions come after
    them: past the budget, each is undecided, none decided."""
    lines = ["schedule: spent", "sizes:", "  A: {max: 100}", "  B: {max: 100}",
             "  C: {max: 4}", "buffers:"]
    lines += [f'  b{i}: {{shape: ["(A - B + {i}) * (A - B + {i}) + {i + 1}"], dtype: f32}}'
              for i in range(buffers)]
    lines += ['  x_send: {shape: [W, C, "A * (A + 1) * 64"], dtype: bf16}',
              "  counts: {shape: [W], dtype: i32}",
              '  q_recv: {shape: [W, C, "A * (A + 1) * 64"], dtype: fp8e4m3, symmetric: true}',
              '  s_recv: {shape: [W, C, "A * (A + 1) / 2"], dtype: f32, symmetric: true}',
              "  n_recv: {shape: [W], dtype: i32, symmetric: true}",
              "steps:",
              "  - e: {op: external, reads: [" + ", ".join(f"b{i}" for i in range(buffers))
              + "]}",
              "  - dispatch: {op: ragged_all_to_all, src: x_send, dst: q_recv, counts: counts,"
              " recv_counts: n_recv, capacity: C,"
              " scale: {per: token, group: 128, buffer: s_recv, rule: deepep}}"]
    return "\n".join(lines) + "\n"


def test_a_spent_budget_is_undecided_never_a_finding() -> None:
    """Past the check's one budget every later question is undecided: each is refused as
    `shape-undecided`, never read as a decided answer. Before, a buffer's dimension was
    asked twice (the second ask found the budget spent and called (A-B+2)**2+3 nonpositive
    at A = B = 1), and a cast's question called A*(A+1)*64 not a multiple of 128."""
    schedule = parse_text(_spent(12), "spent.yaml")
    out = [d for d in check(schedule, list(range(2, 65))) if d.severity == "error"]
    assert out and {d.code for d in out} == {"shape-undecided"}, [d.render() for d in out]
    said = "\n".join(d.render() for d in out)
    assert "'s_recv'" in said and "128 channels divide the rows of 'q_recv'" in said, said
    assert all("cannot be checked for every binding" in d.message for d in out), said


def test_each_dimension_is_asked_once() -> None:
    """Three squares fit the budget when each dimension's questions are asked once (the
    third was refused when its exactness and its sign were asked again: twice the cost)."""
    schedule = parse_text(_spent(3), "spent.yaml")
    out = [d for d in check(schedule, list(range(2, 1025))) if d.severity == "error"]
    assert out == [], [d.render() for d in out]


def _squares(buffers: int) -> tuple[list[str], list[str], list[str]]:
    """Sizes, buffers and a reading step of ``buffers`` squares of two sizes of max 100
    (about 10,000 of the check's 50,000 evaluations each): the budget spent by 12."""
    sizes = ["  A1: {max: 100}", "  A2: {max: 100}"]
    names = [f"sq{i}" for i in range(buffers)]
    lines = [f'  sq{i}: {{shape: ["(A1 - A2 + {i}) * (A1 - A2 + {i}) + {i + 1}"], dtype: f32}}'
             for i in range(buffers)]
    reads = [f"  - sq: {{op: external, reads: [{', '.join(names)}]}}"] if names else []
    return sizes, lines, reads


def _sites(buffers: int) -> str:
    """Each other kind of shape question after the squares, each whole at W = 2 but only
    by trying its cases (a division by W that is not one of polynomials)."""
    sizes, squares, reads = _squares(buffers)
    return "\n".join([
        "schedule: sites", "sizes:", "  A: {max: 100}", "  T: {max: 8}", *sizes, "buffers:",
        *squares,
        '  a: {shape: ["A * (A + 5)", 4], dtype: f32}',
        '  g: {shape: ["W * A * (A + 5)", 4], dtype: f32, symmetric: true}',
        '  p: {shape: [4, "A * (A + 1)"], dtype: f32}',
        '  q: {shape: [W, 4, "A * (A + 1) / W"], dtype: f32, symmetric: true}',
        "  t: {shape: [T, 4], dtype: f32}",
        '  u: {shape: ["2 * T", 4], dtype: f32, symmetric: true}',
        "steps:", *reads,
        "  - e0: {op: external, reads: [a, p, t]}",
        "  - ag: {op: all_gather, src: a, dst: g, interleave: 2}",
        "  - x: {op: all_to_all, src: p, dst: q, dim: 1}",
        "  - tu: {op: all_gather, src: t, dst: u}",
        "  - e: {op: external, reads: [g, q, u]}",
        "  - r: {op: barrier}"]) + "\n"


def test_every_kind_of_shape_question_past_the_budget_is_undecided() -> None:
    """With the budget spent by 12 squares, each later question (a dimension, a gather's
    interleave, an all_to_all's split, two shapes equal) is refused as
    `shape-undecided` at its own place, with the hint that the budget is the file's; the
    same file without the squares checks clean at W = 2. Before, the interleave was
    `bad-interleave` and the gather's dst a `shape-mismatch` 'for W=2 (T=1)', where 2*T
    and W*T are equal."""
    assert [d.render() for d in check(parse_text(_sites(0), "sites.yaml"), [2])
            if d.severity == "error"] == []
    out = [d for d in check(parse_text(_sites(12), "sites.yaml"), [2]) if d.severity == "error"]
    assert {d.code for d in out} == {"shape-undecided"}, [d.render() for d in out]
    said = {d.message.split(" cannot be checked")[0] for d in out if "'sq" not in d.message}
    assert said == {
        "dimension 2 of buffer 'q' [A*(A+1)/W]",
        "whether interleave 2 of step 'ag' divides the rows of src 'a' (A*(A+5))",
        "whether step 'x' splits src 'p' in W whole parts (A*(A+1))",
        "whether dst 'u' of step 'tu' has shape [W*T, 4] (W blocks of src 't' along dim 0)",
    }, said
    assert all("share one budget" in (d.hint or "") for d in out if "'sq" not in d.message)


def test_a_mask_past_the_budget_is_undecided_not_bad_mask() -> None:
    """kimi_k3_dcp_ag_rs with query_start_loc [B+W-1] (one longer than seq_lens [B] at
    W = 2) after 12 squares: undecided, never `bad-mask` 'they differ for W=2'."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "schedules/kimi_k3_dcp_ag_rs.yaml").read_text()
    sizes, squares, reads = _squares(12)
    text = text.replace("query_start_loc: {shape: [B+1],", 'query_start_loc: {shape: ["B+W-1"],')
    text = text.replace("\nsizes:\n", "\nsizes:\n" + "\n".join(sizes) + "\n", 1)
    text = text.replace("\nbuffers:\n", "\nbuffers:\n" + "\n".join(squares) + "\n", 1)
    text = text.replace("\nsteps:\n", "\nsteps:\n" + "\n".join(reads) + "\n", 1)
    assert [d.render() for d in check(parse_text(text.replace('"B+W-1"', "B+1"), "m.yaml"), [2])
            if d.severity == "error" and "'sq" not in d.message] == []
    out = [d for d in check(parse_text(text, "m.yaml"), [2]) if d.severity == "error"]
    assert {d.code for d in out} == {"shape-undecided"}, [d.render() for d in out]
    assert any("query_start_loc" in d.message for d in out), [d.render() for d in out]


def test_a_values_end_past_its_own_budget_is_undecided_with_its_own_hint() -> None:
    """A values end whose sign question alone is too large (a square of two sizes of max
    1000): `shape-undecided` at the end, with the hint to simplify it (its own budget, not
    the file's)."""
    text = GATHER.format(src="T", dst="W*T").replace(
        "  D: 576\n", "  D: 576\n  A3: {max: 1000}\n  A4: {max: 1000}\n").replace(
        "buffers:\n", 'buffers:\n  n: {shape: [4], dtype: i32, values: {min: 0, max: '
        '"(A3 - A4) * (A3 - A4) + 1"}}\n').replace("reads: [b]", "reads: [b, n]")
    out = [d for d in check(parse_text(text, "t.yaml"), [2]) if d.severity == "error"]
    assert [d.code for d in out] == ["shape-undecided"], [d.render() for d in out]
    assert "'values' of buffer 'n'" in out[0].message and "simpler" in (out[0].hint or "")
