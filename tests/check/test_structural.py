"""The structural checks of `dcpc check` (dcpc/check) and size binding (dcpc/lang/sizes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dcpc.check import check
from dcpc.diagnostics import Diagnostic, DiagnosticError
from dcpc.lang import expr as ex
from dcpc.lang.parse import parse_file, parse_text
from dcpc.lang.questions import Samples, equal_on_samples
from dcpc.lang.sizes import max_binding, sample_bindings, size_table
from dcpc.pipeline import default_worlds

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "schedules").glob("*.yaml"))
MALFORMED = sorted((Path(__file__).parents[1] / "malformed").glob("*.yaml"))
EXPECT = re.compile(r"# expect: (?P<code>[a-z-]+) (?P<line>\d+):(?P<col>\d+) (?P<frag>.+)")

TINY = """\
schedule: tiny
slots: 2
sizes:
  T: {max: 64}
  H: {multiple_of: W}
  D: 576
buffers:
  q_local: {shape: [T, H/W, D], dtype: bf16}
  q_full:  {shape: [T, H, D],   dtype: bf16, symmetric: true}
  o_part:  {shape: [T, H, D],   dtype: bf16}
steps:
  - gather:    {op: all_gather, src: q_local, dst: q_full, dim: 1}
  - attention: {op: external, reads: [q_full], writes: [o_part]}
  - release:   {op: barrier}
"""
KIMI = (ROOT / "schedules" / "kimi_k3_dcp.yaml").read_text()
AG_RS = (ROOT / "schedules" / "kimi_k3_dcp_ag_rs.yaml").read_text()
FUSED = (ROOT / "schedules" / "kimi_k3_dcp_fused.yaml").read_text()


def diags(text: str, worlds: range | list[int] = range(2, 9)) -> list[Diagnostic]:
    return check(parse_text(text, "t.yaml"), list(worlds))


def errors(text: str, worlds: range | list[int] = range(2, 9)) -> list[Diagnostic]:
    return [d for d in diags(text, worlds) if d.severity == "error"]


def codes(text: str, worlds: range | list[int] = range(2, 9)) -> list[str]:
    return [d.code for d in errors(text, worlds)]


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# ---- the shipped schedules ------------------------------------------------------

@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("worlds", [range(2, 9), range(2, 73)], ids=["2..8", "2..72"])
def test_shipped_schedules_check_clean(path: Path, worlds: range) -> None:
    assert check(parse_file(path), list(worlds)) == []


def test_shipped_schedules_exist() -> None:
    assert len(SHIPPED) >= 5


# ---- the malformed corpus: one file per error class -----------------------------

def _expectation(path: Path) -> re.Match[str]:
    first = path.read_bytes().split(b"\n", 1)[0].decode("utf-8")
    found = EXPECT.match(first)
    assert found, f"{path.name}: first line must be '# expect: CODE LINE:COL FRAGMENT'"
    return found


@pytest.mark.parametrize("path", MALFORMED, ids=lambda p: p.stem)
def test_malformed(path: Path) -> None:
    want = _expectation(path)
    try:
        schedule = parse_file(path)
        found = check(schedule, default_worlds(schedule))  # 2..8, or a mesh's shapes
    except DiagnosticError as exc:
        found = exc.diagnostics
    matching = [
        d for d in found
        if d.code == want["code"]
        and (d.mark.line, d.mark.col) == (int(want["line"]), int(want["col"]))
    ]
    rendered = "\n".join(d.render() for d in found)
    assert matching, f"expected {want['code']} at {want['line']}:{want['col']}, got\n{rendered}"
    assert want["frag"] in matching[0].message, rendered
    assert matching[0].mark.file == str(path)
    # one error class per file: any other diagnostic is at most a warning
    assert all(d.code == want["code"] or d.severity == "warning" for d in found), rendered


def test_malformed_corpus_covers_one_class_per_file() -> None:
    classes = [_expectation(p)["code"] for p in MALFORMED]
    assert len(classes) >= 30
    assert len(set(classes)) == len(classes)


# ---- every error of a file in one run --------------------------------------------

def test_reports_every_error_in_one_run() -> None:
    text = edit(TINY, "reads: [q_full]", "reads: [q_fulll]")
    text = edit(text, "dim: 1}", "dim: 7}")
    text = edit(text, "o_part:  {shape: [T, H, D]", "o_part:  {shape: [T, Hq, D]")
    text = edit(text, "  - release:", "  - Release:")
    found = errors(text)
    assert sorted(d.code for d in found) == [
        "bad-identifier", "dim-out-of-range", "unknown-buffer", "unknown-size"
    ]
    assert found == sorted(found, key=lambda d: (d.mark, d.code))
    assert all(d.mark.line >= 1 and d.mark.file == "t.yaml" for d in found)


def test_unknown_buffer_everywhere_a_step_names_one() -> None:
    text = edit(KIMI, "dst: out,", "dst: outt, return_lse: lse_out,")
    text = edit(text, "{seq_lens: seq_lens,", "{seq_lens: seqlens,")
    found = [d for d in errors(text) if d.code == "unknown-buffer"]
    names = sorted(re.search(r"buffer '(\w+)'", d.message)[1] for d in found)
    assert names == ["lse_out", "outt", "seqlens"]
    hints = {re.search(r"buffer '(\w+)'", d.message)[1]: d.hint for d in found}
    assert hints["outt"] == "did you mean 'out'?"
    assert hints["seqlens"] == "did you mean 'seq_lens'?"


# ---- identifiers ---------------------------------------------------------------

@pytest.mark.parametrize("name,code", [
    ("Gather", "bad-identifier"), ("2nd", "bad-identifier"), ("class", "bad-identifier"),
    ("match", "bad-identifier"), ("_", "bad-identifier"), ("__init__", "bad-identifier"),
    ("gather-q", "bad-identifier"), ("_gather", "bad-identifier"), ("g" * 49, "bad-identifier"),
    ("close", "reserved-name"), ("world", "reserved-name"), ("check_errors", "reserved-name"),
    # a method's own parameters are its locals, not the class's: free as step names
    ("slot", None), ("sizes", None), ("self", None), ("env", None), ("g" * 48, None),
])
def test_step_name_rules(name: str, code: str | None) -> None:
    text = edit(TINY, "  - gather:", f"  - '{name}':")
    if name.startswith("__"):  # the parser reserves '__' keys before any name rule runs
        with pytest.raises(DiagnosticError) as exc:
            errors(text)
        found = exc.value.diagnostics
        code = "reserved-key"
    else:
        found = errors(text)
    if code is None:
        assert found == []
        return
    assert [d.code for d in found] == [code]
    assert (found[0].mark.line, found[0].mark.col) == (12, 5)


@pytest.mark.parametrize("name", ["os", "torch", "json", "Kimi", "if", "__x", "_1", "_tiny",
                                  "none", "'true'", "t" * 49])
def test_schedule_name_rules(name: str) -> None:
    found = errors(edit(TINY, "schedule: tiny", f"schedule: {name}"))
    assert len(found) == 1 and found[0].code in ("bad-identifier", "reserved-name")
    assert (found[0].mark.line, found[0].mark.col) == (1, 11)


def test_buffer_and_size_names() -> None:
    text = edit(TINY, "  o_part:", "  O_part:")
    text = edit(text, "writes: [o_part]", "writes: [O_part]")
    text = edit(text, "  D: 576", "  D: 576\n  W: 4\n  n-1: 3")
    found = errors(text)
    assert sorted((d.code, d.mark.line) for d in found) == [
        ("bad-identifier", 8), ("bad-identifier", 12), ("reserved-name", 7)
    ]
    assert any("'n-1'" in d.message for d in found)
    # size names may be upper case
    assert errors(edit(TINY, "T: {max: 64}", "Tok: {max: 64}").replace("[T,", "[Tok,")) == []


def test_duplicate_step_and_name_clash() -> None:
    found = errors(edit(TINY, "  - release:", "  - gather:"))
    assert [d.code for d in found] == ["duplicate-step"]
    assert found[0].hint and "line 12" in found[0].hint
    assert codes(edit(TINY, "  - release:", "  - q_full:")) == ["name-clash"]


# ---- sizes, shapes, divisibility -------------------------------------------------

def test_inexact_division_names_w_and_binding() -> None:
    found = errors(edit(TINY, "o_part:  {shape: [T, H, D]", "o_part:  {shape: [T, H, D/W]"))
    assert [d.code for d in found] == ["inexact-division"]
    assert "D/W is not a whole number for W=5 (D=576)" in found[0].message
    assert errors(edit(TINY, "o_part:  {shape: [T, H, D]", "o_part:  {shape: [T, H, D/W]"),
                  worlds=[2, 4, 8]) == []


def test_runtime_size_division_counterexample_uses_edge_values() -> None:
    found = errors(edit(TINY, "o_part:  {shape: [T, H, D]", "o_part:  {shape: [T/2, H, D]"))
    assert [d.code for d in found] == ["inexact-division"]
    assert "T=1" in found[0].message or "T=3" in found[0].message


def test_multiple_of_with_constants_and_bad_expressions() -> None:
    assert errors(edit(TINY, "H: {multiple_of: W}", "H: {multiple_of: 2*W}")) == []
    assert codes(edit(TINY, "H: {multiple_of: W}", "H: {multiple_of: W-2}")) == [
        "bad-multiple-of"
    ]
    found = errors(edit(TINY, "H: {multiple_of: W}", "H: {multiple_of: 'W/3'}"))
    assert [d.code for d in found] == ["bad-multiple-of"]
    assert "W=2" in found[0].message
    assert codes(edit(TINY, "H: {multiple_of: W}", "H: {multiple_of: 'W+'}")) == ["shape-syntax"]


def test_zero_and_negative_sizes() -> None:
    assert codes(edit(TINY, "D: 576", "D: 0")) == ["nonpositive-dim"]
    assert codes(edit(TINY, "D: 576", "D: -4")) == ["nonpositive-dim"]
    found = errors(edit(TINY, "o_part:  {shape: [T, H, D]", "o_part:  {shape: [T-2, H, D]"))
    assert [d.code for d in found] == ["nonpositive-dim"] and "T=1" in found[0].message


def test_shape_syntax_column_points_into_the_expression() -> None:
    found = errors(edit(TINY, "[T, H/W, D]", "[T, H/W$, D]"))
    assert [d.code for d in found] == ["shape-syntax"]
    # 'H/W$' starts at column 24; '$' is its 4th character
    assert (found[0].mark.line, found[0].mark.col) == (8, 27)
    assert "'$'" in found[0].message


def test_deep_and_long_expressions_are_diagnostics() -> None:
    deep = "(" * 400 + "T" + ")" * 400
    assert codes(edit(TINY, "[T, H, D],   dtype: bf16}", f"['{deep}', H, D], dtype: bf16}}")) == [
        "shape-syntax"
    ]
    chain = "+".join(["T"] * 100)
    assert codes(edit(TINY, "[T, H, D],   dtype: bf16}", f"['{chain}', H, D], dtype: bf16}}")) == [
        "shape-syntax"
    ]


# ---- per-op rules ----------------------------------------------------------------

def test_all_gather_stack_and_negative_dim() -> None:
    # a negative dim is refused with the index it means (the lowerings read dim as
    # written: all_gather at dim -1 ran past its buffer, at -2 stored 6 wrong values)
    found = errors(edit(AG_RS, "dst: lse_all, dim: 0", "dst: lse_all, dim: -3"))
    assert [e.code for e in found] == ["dim-out-of-range"]
    assert "write 0 (dim -3 of 3 dims, counted from the end)" in found[0].message
    text = edit(AG_RS, "lse_all:   {shape: [W, T, H]", "lse_all:   {shape: [T, W, H]")
    assert "shape-mismatch" in codes(text)
    assert codes(edit(AG_RS, "dst: lse_all, dim: 0", "dst: lse_all, dim: 3")) == [
        "dim-out-of-range"
    ]


def test_all_gather_needs_concat_or_stack_rank() -> None:
    found = errors(edit(TINY, "q_full:  {shape: [T, H, D]", "q_full:  {shape: [T, H, D, 2, 2]"))
    assert "shape-mismatch" in [d.code for d in found]
    assert any("needs 3 (blocks concatenated along dim) or 4" in d.message for d in found)


def test_all_to_all_split_must_divide() -> None:
    text = edit(KIMI, "dst: [o_recv, lse_recv], dim: 1", "dst: [o_recv, lse_recv], dim: 0")
    found = errors(text)
    assert "inexact-division" in [d.code for d in found]
    assert any("T/W is not a whole number" in d.message for d in found)


def test_all_to_all_dst_shape() -> None:
    text = edit(KIMI, "o_recv:    {shape: [W, T, H/W, Dv]", "o_recv:    {shape: [T, H/W, Dv]")
    found = errors(text)
    assert {d.code for d in found} == {"shape-mismatch"}  # in out_exchange and in merge
    assert any("[W, T, H/W, Dv]" in d.message and d.mark.line == 26 for d in found)


def test_reduce_scatter_rules() -> None:
    assert codes(edit(AG_RS, "o_rs_recv: {shape: [W, T, H/W, Dv], dtype: f32, symmetric: true}",
                      "o_rs_recv: {shape: [W, T, H/W, Dv], dtype: f32}")) == ["not-symmetric"]
    found = errors(edit(AG_RS, "out:       {shape: [T, H/W, Dv]", "out:       {shape: [T, H, Dv]"))
    assert [d.code for d in found] == ["shape-mismatch"]
    assert "'out'" in found[0].message
    # a float dst may be narrower than src (summed in fp32, rounded once), not an integer
    assert codes(edit(AG_RS, "out:       {shape: [T, H/W, Dv],    dtype: bf16}",
                      "out:       {shape: [T, H/W, Dv],    dtype: f16}")) == []
    assert codes(edit(AG_RS, "out:       {shape: [T, H/W, Dv],    dtype: bf16}",
                      "out:       {shape: [T, H/W, Dv],    dtype: i32}")) == ["non-float-output"]
    # without via the receive buffer is implicit; dst is still checked
    text = edit(AG_RS, ", via: o_rs_recv", "")
    assert codes(text) == [] and [d.code for d in diags(text)] == ["unused-buffer"]


def test_lse_correct_rules() -> None:
    text = edit(AG_RS, "o_corr:    {shape: [T, H, Dv]", "o_corr:    {shape: [T, H, D]")
    assert "shape-mismatch" in codes(text)
    found = errors(edit(AG_RS, "symmetric: true, lse_base: e}", "symmetric: true}"))
    assert sorted(d.code for d in found) == ["missing-lse-base", "missing-lse-base"]
    assert {d.mark.line for d in found} == {29, 30}  # the transfer and the merge
    assert any("lse_base" in (d.hint or "") for d in found)


def test_lse_combine_shapes_and_return_lse() -> None:
    text = edit(KIMI, "out:       {shape: [T, H/W, Dv]", "out:       {shape: [W, T, H/W, Dv]")
    assert codes(text) == ["shape-mismatch"]
    text = edit(KIMI, "  seq_lens:", "  out_lse:   {shape: [T, H],  dtype: f32, lse_base: e}\n"
                "  seq_lens:")
    text = edit(text, "dst: out,", "dst: out, return_lse: out_lse,")
    found = errors(text)
    assert [d.code for d in found] == ["shape-mismatch"]
    assert "'out_lse'" in found[0].message and "[T, H/W]" in found[0].message


def test_lse_base_rules() -> None:
    text = edit(KIMI, "dst: out,", "dst: out, lse_base: 2,")
    found = errors(text)
    assert [d.code for d in found] == ["lse-base-mismatch"]
    assert found[0].hint == "use 'lse_base: e' or drop it from the step"
    assert errors(edit(KIMI, "dst: out,", "dst: out, lse_base: e,")) == []
    text = edit(FUSED, "dtype: f32, lse_base: e}\n  seq_lens",
                "dtype: f32, lse_base: 2}\n  seq_lens")
    assert codes(text) == ["lse-base-mismatch"]
    text = edit(FUSED, "dtype: f32, lse_base: e}\n  seq_lens", "dtype: f32}\n  seq_lens")
    assert codes(text) == ["missing-lse-base"]


def test_lse_dtypes() -> None:
    text = edit(KIMI, "lse_recv:  {shape: [W, T, H/W],     dtype: f32",
                "lse_recv:  {shape: [W, T, H/W],     dtype: fp8e4m3")
    text = edit(text, "lse_part:  {shape: [T, H],          dtype: f32",
                "lse_part:  {shape: [T, H],          dtype: fp8e4m3")
    assert set(codes(text)) == {"bad-lse-dtype"}
    text = edit(KIMI, "lse_part:  {shape: [T, H],          dtype: f32, lse_base: e}",
                "lse_part:  {shape: [T, H],          dtype: i32, lse_base: e}")
    assert "lse-base-not-float" in codes(text)


def test_all_to_all_combine_rules() -> None:
    text = edit(FUSED, "lse_recv:  {shape: [W, T, H/W],     dtype: f32, symmetric: true",
                "lse_recv:  {shape: [W, T, H/W],     dtype: f32")
    assert codes(text) == ["not-symmetric"]
    text = edit(FUSED, "o_recv:    {shape: [W, T, H/W, Dv], dtype: bf16",
                "o_recv:    {shape: [W, T, H/W, Dv], dtype: f16")
    assert codes(text) == ["dtype-mismatch"]
    text = edit(FUSED, "out_lse:   {shape: [T, H/W],        dtype: f32",
                "out_lse:   {shape: [T, H/W],        dtype: bf16")
    assert codes(text) == ["bad-lse-dtype"]


def test_mask_buffers() -> None:
    text = edit(KIMI, "seq_lens:  {shape: [B],             dtype: i32}",
                "seq_lens:  {shape: [B],             dtype: f32}")
    found = errors(text)
    assert [d.code for d in found] == ["bad-mask"] and "1-D integer" in found[0].message
    text = edit(KIMI, "seq_lens:  {shape: [B],", "seq_lens:  {shape: [B, 2],")
    assert codes(text) == ["bad-mask"]


def test_copy_rules() -> None:
    staging = (ROOT / "schedules" / "kimi_k3_dcp_staging.yaml").read_text()
    text = edit(staging, "q_full:    {shape: [T, H, D]", "q_full:    {shape: [T, H/W, D]")
    assert codes(text) == ["shape-mismatch"]


# ---- order within a call and channels ---------------------------------------------

def test_engine_owned_read_before_its_writer() -> None:
    text = edit(TINY, "  - release:   {op: barrier}",
                "  - release:   {op: barrier}\n  - late:      {op: external, writes: [q_local]}")
    found = errors(text)
    assert [d.code for d in found] == ["read-before-write"]
    assert "before step 'late' writes it" in found[0].message
    assert (found[0].mark.line, found[0].mark.col) == (12, 38)


def test_engine_owned_inputs_and_in_place_updates_are_fine() -> None:
    text = edit(TINY, "reads: [q_full]", "reads: [q_full, o_part]")
    assert errors(text) == []
    text = edit(TINY, "writes: [o_part]", "writes: [o_part, q_local]")
    assert codes(text) == ["read-before-write"]


def test_signal_wait_pairs() -> None:
    ring = edit(TINY, "  - release:   {op: barrier}",
                "  - done:      {op: signal, to: next, channel: ring}\n"
                "  - release:   {op: wait, from: prev, channel: ring}")
    assert diags(ring) == []
    everyone = ring.replace("to: next", "to: all").replace("from: prev", "from: all")
    assert diags(everyone) == []
    found = errors(ring.replace("from: prev", "from: next"))
    assert [d.code for d in found] == ["peer-mismatch"]
    assert found[0].hint == "use 'to: prev' or 'to: all' on 'done', or another 'from' here"
    # `to: all` reaches a wait from either neighbour (docs/language.md)
    assert diags(everyone.replace("from: all", "from: prev")) == []
    assert diags(everyone.replace("from: all", "from: next")) == []


# ---- the size sampler and binding (dcpc.lang.sizes) --------------------------------

def test_sampler_includes_edge_values() -> None:
    table = size_table(parse_text(KIMI))
    for world in (2, 5, 72):
        bindings = sample_bindings(table, world)
        assert bindings and all(b["W"] == world for b in bindings)
        ts = {b["T"] for b in bindings}
        assert {1, 2, 3, 512} <= ts
        hs = {b["H"] for b in bindings}
        assert world in hs and len(hs) >= 3 and all(h % world == 0 for h in hs)
        assert {b["D"] for b in bindings} == {576}


def test_sampler_respects_max_with_multiple_of() -> None:
    text = edit(TINY, "H: {multiple_of: W}", "H: {multiple_of: W, max: 24}")
    table = size_table(parse_text(text))
    for world in range(2, 9):
        hs = {b["H"] for b in sample_bindings(table, world)}
        assert hs and all(h % world == 0 and h <= 24 for h in hs)


def test_equal_on_samples() -> None:
    table = size_table(parse_text(KIMI))
    samples = Samples(table, range(2, 9))
    assert equal_on_samples(ex.parse("W*(H/W)"), ex.parse("H"), samples)
    assert not equal_on_samples(ex.parse("H/W"), ex.parse("H"), samples)
    assert equal_on_samples(ex.parse("B+1"), ex.parse("1+B"), samples)
    example = samples.shapes_differ([ex.parse("T*2")], [ex.parse("T+T")])
    assert example is None
    example = samples.inexact(ex.parse("D/W"))
    assert example is not None and example.world == 5


def test_max_binding() -> None:
    schedule = parse_text(KIMI)
    assert max_binding(schedule, 4, {"H": 96}) == {
        "W": 4, "T": 512, "B": 256, "H": 96, "D": 576, "Dv": 512
    }
    assert max_binding(schedule, 4)["H"] == 4
    assert max_binding(schedule, 4, {"T": 64})["T"] == 64
    for bad in ({"H": 97}, {"T": 513}, {"D": 1}, {"Q": 1}, {"H": 0}):
        with pytest.raises(ValueError):
            max_binding(schedule, 4, bad)


def test_bad_worlds_are_a_diagnostic() -> None:
    found = check(parse_text(TINY, "t.yaml"), [0, 2])
    assert [d.code for d in found] == ["bad-world"]
    assert found[0].mark.line == 0


def test_a_schedule_past_the_limits_is_refused_at_once() -> None:
    from dcpc.check.structural import MAX_ACCESSES, MAX_STEPS

    head = ("schedule: big\nsizes: {N: 4, K: {multiple_of: W}}\nbuffers:\n"
            "  x: {shape: [N, K], dtype: f32}\n"
            "  g: {shape: [W*N, K], dtype: f32, symmetric: true}\nsteps:\n"
            "  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n")
    many = head + "".join(f"  - use{i}: {{op: external, reads: [g]}}\n"
                          for i in range(MAX_STEPS))
    with pytest.raises(DiagnosticError) as err:  # refused by the parse, before the model
        parse_text(many, "t.yaml")
    (found,) = err.value.diagnostics
    assert found.code == "schedule-too-large" and f"{MAX_STEPS + 1} steps" in found.message
    wide = head + "  - use: {op: external, reads: [" + ", ".join(["g"] * MAX_ACCESSES) + "]}\n"
    (found,) = diags(wide)
    assert found.code == "schedule-too-large" and str(MAX_ACCESSES + 2) in found.message
    assert diags(head + "  - use: {op: external, reads: [g]}\n") == []


NEGATIVE_DIM = """
schedule: neg
sizes: {T: {max: 8}, D: 4}
buffers:
  x:     {shape: [T, W * D], dtype: f32, symmetric: true}
  x_all: {shape: [T, W, W * D], dtype: f32, symmetric: true}
  y:     {shape: [W, T, D], dtype: f32, symmetric: true}
  z:     {shape: [T, D], dtype: f32}
steps:
  - stage: {op: external, writes: [x]}
  - STEP
  - release: {op: barrier}
"""


@pytest.mark.parametrize("step", [
    "gather: {op: all_gather, src: x, dst: x_all, dim: -2}",
    "swap: {op: all_to_all, src: x, dst: y, dim: -1}",
    "rs: {op: reduce_scatter, src: x, dst: z, dim: -1}",
])
def test_a_negative_dim_is_refused_with_the_dim_it_means(step: str) -> None:
    """Checked and proved before, a negative dim ran wrong: all_gather at -1 past its
    buffer (the ranks died of SIGSEGV), at -2 and all_to_all at -1 with wrong values."""
    found = errors(NEGATIVE_DIM.replace("STEP", step))
    assert [e.code for e in found] == ["dim-out-of-range"], found
    assert "counted from the end" in found[0].message
