"""sum (dcpc/ops/sum.py), the local sum over one dim (issue 33 item 7: with pull, vLLM's
one-shot custom all-reduce): the verifier's refusals located, the float64 reference
(in order from +0, one rounding), the kernel and the torch body against it with NaN,
inf and -0 inputs (a NaN never passes), and dcpc run on host, torch and local at W 2, 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.kernels import compile_text, load, the_class

from dcpc.check import structural
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import simulate_call
from dcpc.harness.worker import OutputStats, compare
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
SUM = ROOT / "schedules" / "ops" / "sum.yaml"

HEAD = """\
schedule: s
sizes: {T: {max: 8}, K: 3, D: 4}
buffers:
  x:   {shape: [T, K, D], dtype: bf16}
  xi:  {shape: [T, K, D], dtype: i32}
  x1:  {shape: [T], dtype: f32}
  y:   {shape: [T, D], dtype: f32}
  yi:  {shape: [T, D], dtype: i32}
  y8:  {shape: [T, D], dtype: fp8e4m3}
  yk:  {shape: [K, D], dtype: f32}
  s:   {shape: [1], dtype: f32}
steps:
  - make: {op: external, writes: [x, xi, x1, s]}
"""


def _errors(line: str) -> list[Any]:
    """The errors of HEAD with ``line`` as its last step, at W 2..4 (a parse error's too)."""
    try:
        return [d for d in structural.check(parse_text(HEAD + line + "\n", "s.yaml"),
                                            range(2, 5)) if d.severity == "error"]
    except Exception as error:  # a parse error is raised with its diagnostics
        return list(error.diagnostics)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("step", "code", "at", "says"), [
    ("{op: sum, src: xi, dst: y, dim: 1}", "non-float-output", "xi,",
     "src 'xi' of sum 'total' is i32; it sums in fp32"),
    ("{op: sum, src: x, dst: yi, dim: 1}", "non-float-output", "yi,", "dst 'yi'"),
    ("{op: sum, src: x, dst: y}", "shape-mismatch", "y}", "summed over its dim 0"),
    ("{op: sum, src: x1, dst: y}", "shape-mismatch", "x1,", "has 1 dim; it needs at least 2"),
    ("{op: sum, src: x, dst: y, dim: 3}", "dim-out-of-range", "3}", "valid: 0..2"),
    ("{op: sum, src: x, dst: y, dim: -2}", "dim-out-of-range", "-2}", "write 1"),
    ("{op: sum, src: x, dst: y8, dim: 1}", "missing-output-scale", "y8,",
     "writes fp8 output 'y8' without a scale"),
    ("{op: sum, src: x, dst: y, dim: 1, output_scale: s}", "bad-output-scale", "s}", "'y'"),
    ("{op: sum, src: [x], dst: y}", "wrong-type", "[x]", ""),
    ("{op: sum, src: x, dst: y, dim: 1, bogus: 1}", "unknown-key", "bogus", "bogus"),
    ("{op: sum, src: x}", "missing-key", "{op", "dst"),
])
def test_bad_steps_are_located_errors(step: str, code: str, at: str, says: str) -> None:
    line = f"  - total: {step}"
    found = _errors(line)
    where = (code, HEAD.count("\n") + 1, line.index(at) + 1)
    assert [(d.code, d.mark.line, d.mark.col) for d in found][:1] == [where], found
    assert says in found[0].message, found[0].message


@pytest.mark.parametrize("step", ["{op: sum, src: x, dst: y, dim: 1}",
                                  "{op: sum, src: x, dst: yk}",
                                  "{op: sum, src: x, dst: y8, dim: 1, output_scale: s}"])
def test_good_steps_are_accepted(step: str) -> None:
    assert _errors(f"  - total: {step}") == []


SUMS = """\
schedule: sums
sizes: {T: 3, K: 4, D: 5}
buffers:
  x:   {shape: [T, K, D], dtype: f32}
  xb:  {shape: [K, T, D], dtype: bf16}
  y:   {shape: [T, D], dtype: f32}
  yb:  {shape: [T, D], dtype: bf16}
steps:
  - total: {op: sum, src: x, dst: y, dim: 1}
  - lead:  {op: sum, src: xb, dst: yb}
"""
SIZES = {"T": 3, "K": 4, "D": 5}


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    """x and xb with NaN, +inf and -inf (one column sums inf + -inf) and a column of -0s."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 5, generator=g) * 100
    x[0, 1, 2] = float("nan")
    x[1, 0, 0], x[1, 3, 0] = float("inf"), -float("inf")
    x[2, 0, 3] = float("inf")
    x[2, :, 1] = -0.0
    return {"x": x, "xb": x.transpose(0, 1).contiguous().bfloat16()}


def _float64(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(x.select(dim, 0).shape, dtype=torch.float64)
    for k in range(x.shape[dim]):
        out += x.select(dim, k).double()
    return out.to(dtype).double()


def test_the_reference_sums_in_order_from_plus_zero_and_rounds_once() -> None:
    case = _inputs(1)
    out = simulate_call(parse_text(SUMS), 2, SIZES, [{k: v.double() for k, v in case.items()}] * 2,
                        external=None)
    for rank in range(2):
        y, yb = out[rank]["y"], out[rank]["yb"]
        assert torch.equal(y.isnan(), _float64(case["x"], 1, torch.float32).isnan())
        want = _float64(case["x"], 1, torch.float32)
        assert torch.equal(y.nan_to_num(), want.nan_to_num())
        assert bool(y[0, 2].isnan()) and bool(y[1, 0].isnan())  # NaN; inf + -inf
        assert y[2, 3].item() == float("inf")
        assert str(y[2, 1].item()) == "0.0"  # a sum of -0s is +0
        want_b = _float64(case["xb"], 0, torch.bfloat16)  # fp32-exact parts: one rounding
        assert torch.equal(yb.nan_to_num(), want_b.nan_to_num())
        assert torch.equal(yb.isnan(), want_b.isnan())


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter: inf + -inf
@pytest.mark.parametrize("backend", ["host", "torch"])
def test_the_kernel_and_the_torch_body_match_float64_with_nan_and_inf(
        backend: str, tmp_path: Path) -> None:
    """W=1 (a local op needs no peer): every output matches the reference under dcpc
    run's own comparison, NaN and inf where it has them; a result that lost the NaN is a
    mismatch (NaN never passes)."""
    cls: Any = the_class(load(compile_text(SUMS, tmp_path, (1, 2))))
    case = _inputs(2)
    m = cls(None, sizes={}, device="cpu", backend=backend)
    got = {"y": m.total(case["x"]).clone(), "yb": m.lead(case["xb"]).clone()}
    m.close()
    want = simulate_call(parse_text(SUMS), 1, SIZES, [{k: v.double() for k, v in case.items()}],
                         external=None)[0]
    for name, dtype in (("y", "f32"), ("yb", "bf16")):
        stats = OutputStats()
        compare(name, "math", dtype, got[name], want[name], stats, "call 0")
        assert stats.mismatches == 0, stats.first_mismatch
        assert torch.equal(got[name].isnan(), want[name].isnan())
        assert str(got[name][2, 1].item()) == "0.0"  # +0, the reference's sign
        lost = OutputStats()
        compare(name, "math", dtype, got[name].nan_to_num(0.0), want[name], lost, "call 0")
        assert lost.mismatches == 1, name


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [
    (2, "host"), (3, "host"), (2, "torch"), (3, "torch"), (2, "local"), (3, "local")], ids=str)
def test_dcpc_run_matches_float64(world: int, backend: str) -> None:
    report = run_schedule(RunConfig(schedule=str(SUM), world=world, backend=backend,
                                    calls=5, seed=3, programs=2, sizes={"T": 24}))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    for name in ("y", "y_mid", "y_fp8"):
        assert report.outputs[name].compared == 5 * world, (name, text)
