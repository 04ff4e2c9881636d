"""fp8 results and scales (issue 31): every op that computes its dst needs ``output_scale``
for an fp8 dst (one rule), a per-tensor scale must be a positive finite normal on every
backend and in the float64 reference, and a zero has one sign on every backend.

Before: all_reduce, reduce and weighted_combine accepted an fp8 dst without a scale and
wrapped sums past 448 (576 -> 288, 480 -> NaN, 1000 -> 256); a scale of 0, a denormal,
a negative, NaN or inf was used as given; a sum of -0s was -0 on torch and +0 on host,
a max of -0 and +0 depended on the backend, and a cast of -0.0 (or of a tiny negative)
to e4m3 was +0 on the kernels and -0 on torch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support.kernels import compile_text, load, the_class

from dcpc.diagnostics import DiagnosticError
from dcpc.harness import simulate
from dcpc.harness.launch import launch
from dcpc.lang.parse import parse_text
from dcpc.pipeline import Options, run

pytestmark = pytest.mark.host

SUMS = """\
schedule: fp8_results
sizes:
  N: 4
buffers:
  x:    {shape: [N, 4], dtype: f32}
  x8:   {shape: [N, 4], dtype: fp8e4m3}
  s:    {shape: [1], dtype: f32}
  w:    {shape: [N, 2], dtype: f32}
  xk:   {shape: [N, 2, 4], dtype: f32}
  ar:   {shape: [N, 4], dtype: fp8e4m3}
  mx:   {shape: [N, 4], dtype: fp8e4m3}
  ar8:  {shape: [N, 4], dtype: f32}
  rd:   {shape: [N, 4], dtype: fp8e4m3}
  rs:   {shape: [N/W, 4], dtype: fp8e4m3}
  wc:   {shape: [N, 4], dtype: fp8e4m3}
steps:
  - make:  {op: external, writes: [x, x8, w, xk, s]}
  - sum:   {op: all_reduce, src: x, dst: ar, output_scale: s}
  - top:   {op: all_reduce, src: x, dst: mx, reduce: max, output_scale: s}
  - sum8:  {op: all_reduce, src: x8, dst: ar8}
  - red:   {op: reduce, src: x, dst: rd, output_scale: s}
  - rsum:  {op: reduce_scatter, src: x, dst: rs, dim: 0, output_scale: s}
  - comb:  {op: weighted_combine, src: [xk, w], dst: wc, output_scale: s}
  - use:   {op: external, reads: [ar, mx, ar8, rd, rs, wc]}
  - release: {op: barrier}
"""
OUTPUTS = {"sum": "ar", "top": "mx", "sum8": "ar8", "red": "rd", "rsum": "rs", "comb": "wc"}
BAD_SCALES = [0.0, -0.0, 2.0**-127, -1.0, math.nan, math.inf, -math.inf, 2.0**127]
BACKENDS = ("host", "local", "torch")


# ---- the one rule: an fp8 result needs output_scale -------------------------------------


@pytest.mark.parametrize("step", ["sum", "top", "red", "rsum", "comb"])
def test_an_fp8_result_without_output_scale_is_refused(tmp_path: Path, step: str) -> None:
    line = next(x for x in SUMS.splitlines() if x.startswith(f"  - {step}:"))
    text = SUMS.replace(line, line.replace(", output_scale: s", ""))
    path = tmp_path / "fp8.yaml"
    path.write_text(text)
    with pytest.raises(DiagnosticError) as err:
        run(path, Options(worlds=(2, 4)))
    found = [(d.code, d.mark.line, d.message) for d in err.value.diagnostics]
    dst = OUTPUTS[step]
    line_no = SUMS.splitlines().index(line) + 1
    assert found == [("missing-output-scale", line_no,
                      f"step '{step}' writes fp8 output '{dst}' without a scale")], found


def test_lse_correct_into_fp8_needs_output_scale_too(tmp_path: Path) -> None:
    """The rule is the op's, not a list of ops: lse_correct (w * o) computes its dst."""
    text = MERGES.replace(", output_scale: s}\n  - use", "}\n  - use")
    path = tmp_path / "merges.yaml"
    path.write_text(text)
    with pytest.raises(DiagnosticError) as err:
        run(path, Options(worlds=(2,)))
    assert [d.code for d in err.value.diagnostics] == ["missing-output-scale"]


def test_every_op_that_computes_its_dst_declares_output_scale() -> None:
    """Moves copy bits (a dtype change is refused or is a cast with its own scale); every
    other op with a dst computes it and so takes the scale an fp8 dst needs."""
    from dcpc.ops import OPS
    from dcpc.ops.common import OUTPUT_SCALE

    scaled = {n for n, op in OPS.items() if OUTPUT_SCALE in op.model.model_fields}
    # a floor, as the moves' below: a new op that computes its dst joins by the rule
    # (with_dst - moves), not by a second list here (docs/internals.md's recipe)
    assert scaled >= {"all_reduce", "reduce", "reduce_scatter", "weighted_combine",
                      "lse_combine", "lse_correct", "all_to_all_combine"}
    with_dst = {n for n, op in OPS.items() if "dst" in op.model.model_fields}
    moves = {n for n in with_dst if OPS[n].exact}  # OpDef.exact: its dst holds src's bits
    assert moves >= {"all_gather", "all_to_all", "broadcast", "copy", "shift"}
    assert with_dst - moves == scaled, (with_dst - moves) ^ scaled


# ---- running it: every CPU backend, and the reference ------------------------------------


def _inputs(rank: int, scale: float, rows: list[list[float]] | None = None) -> dict[str, Any]:
    x = torch.tensor(rows if rows is not None else [[288.0, 240.0, 500.0, 100.0]] * 4)
    return {"x": x, "x8": x.clamp(-448, 448).to(torch.float8_e4m3fn), "s": torch.tensor([scale]),
            "w": torch.ones(4, 2), "xk": torch.stack([x, x], dim=1)}


def _steps(cls: type) -> list[str]:
    return [n for n in cls.METHODS if n != "release"]  # the steps that return a dst


def _bits(t: torch.Tensor) -> list[int]:
    t = t.detach().contiguous()
    view = torch.uint8 if t.element_size() == 1 else torch.int32
    return t.view(view).flatten().tolist()


def _calls(m: Any, rank: int, scale: float, rows: Any, until: str | None) -> dict:
    """Each step's output bits, in the contract's order, or the error of the first step
    that raised; ``until``: the steps before it get scale 1, it gets ``scale``, the
    rest are not called (None: every step gets ``scale``)."""
    good = _inputs(rank, 1.0, rows[rank] if rows else None)
    i = _inputs(rank, scale, rows[rank] if rows else None)
    out: dict[str, Any] = {}
    for name in _steps(type(m)):
        try:
            given = good if until not in (None, name) else i
            out[name] = _bits(getattr(m, name)(*(given[b] for b in type(m).METHODS[name])))
        except Exception as exc:  # noqa: BLE001 (the test asserts on it)
            out["error"] = (type(exc).__name__, str(exc))
            return out
        if name == until:
            return out
    m.release()
    return out


def _class(path: str) -> type:
    os.environ["TRITON_INTERPRET"] = "1"
    import warnings

    warnings.filterwarnings("ignore")
    return the_class(load(path))


def worker(rank: int, world: int, path: str, backends: list[str], cases: list) -> dict:
    """Every (scale, rows, until) case on each backend, a fresh instance per case."""
    import torch.distributed as dist

    cls = _class(path)
    out = {}
    for backend in backends:
        for k, (scale, rows, until) in enumerate(cases):
            m = cls(dist.group.WORLD, sizes={}, device="cpu", backend=backend, timeout_s=60)
            out[f"{backend}/{k}"] = got = _calls(m, rank, scale, rows, until)
            if "error" in got and backend == "torch":
                m.close()  # its failure notices broke the gloo pairs: nothing more here
                return out
            dist.barrier()  # no rank frees its heap while a peer may still store into it
            m.close()
    return out


def _local(path: str, cases: list) -> list[dict]:
    from dcpc.runtime.local import LocalGroup

    cls = _class(path)
    got: list[dict] = [{}, {}]

    def body(rank: Any) -> None:
        for k, (scale, rows, until) in enumerate(cases):
            m = cls(rank, sizes={}, device="cpu", backend="local", timeout_s=60)
            got[rank.rank][f"local/{k}"] = _calls(m, rank.rank, scale, rows, until)
            rank.barrier()
            m.close()

    LocalGroup(2, "cpu", timeout_s=300).run(body)
    return got


def _every_backend(tmp_path: Path, text: str, cases: list) -> list[dict]:
    """Per rank (W=2): {"<backend>/<case>": what _calls saw}, host and torch in processes
    (gloo, shared memory), local as threads."""
    path = str(compile_text(text, tmp_path, (1, 2)))
    result = launch("test_fp8_results:worker", 2,
                    {"path": path, "backends": ["host", "torch"], "cases": cases},
                    timeout_s=600)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    per_rank = [dict(v) for v in result.values()]
    for rank, got in enumerate(_local(path, cases)):
        per_rank[rank].update(got)
    return per_rank


def _reference(text: str, scale: float, rows: Any) -> list[dict[str, list[int]]]:
    """The float64 reference's output bits per rank, as stored in each dst's dtype."""
    schedule = parse_text(text, "ref.yaml")
    inputs = []
    for rank in range(2):
        i = _inputs(rank, scale, rows[rank] if rows else None)
        inputs.append({k: v.to(torch.float64) for k, v in i.items()})
    out = simulate.simulate_call(schedule, 2, {"N": 4}, inputs, lambda *_: {})
    outputs = {s.name: s.op.dst for s in schedule.step_list() if hasattr(s.op, "dst")}
    bits = []
    for rank in range(2):
        mine = {}
        for step, name in outputs.items():
            dtype = simulate.TORCH_DTYPES[schedule.buffers[name].dtype.value]
            mine[step] = _bits(out[rank][name].to(dtype))
        bits.append(mine)
    return bits


def _agree(got: list[dict], text: str, cases: list) -> None:
    """Every backend's bits of every step equal the reference's, on both ranks."""
    for k, (scale, rows, _) in enumerate(cases):
        want = _reference(text, scale, rows)
        for rank in range(2):
            for backend in BACKENDS:
                seen = got[rank][f"{backend}/{k}"]
                assert "error" not in seen, (backend, seen)
                for step, bits in want[rank].items():
                    assert seen[step] == bits, (backend, k, rank, step, seen[step], bits)


def test_sums_past_448_saturate_on_every_backend(tmp_path: Path) -> None:
    """Sums of 576, 480, 1000 and 200 into fp8: 448, 448, 448, 208 (scale 1) and their
    quarter on the e4m3 grid (scale 4), equal bit for bit to the reference on host,
    local and torch; an fp8 src sums (torch: it used to fail in gloo)."""
    cases = [(1.0, None, None), (4.0, None, None)]
    _agree(_every_backend(tmp_path, SUMS, cases), SUMS, cases)
    sums = _reference(SUMS, 1.0, None)[0]["sum"][:4]  # 576, 480, 1000, 200: saturated
    e4m3 = torch.tensor(sums, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    assert e4m3 == [448.0, 448.0, 448.0, 208.0], e4m3  # 200: a tie, away from zero


# the same results into e5m2 (the fp8 src of sum8 stays e4m3: no op sums e5m2)
SUMS_E5M2 = "\n".join(line.replace("fp8e4m3", "fp8e5m2") if not line.startswith("  x8:")
                       else line for line in SUMS.splitlines()) + "\n"


def test_sums_into_e5m2_saturate_and_round_on_every_backend(tmp_path: Path) -> None:
    """Sums of 576, 480, 1000 and 200 into fp8e5m2 (output_scale; issue 33): scale 2**-6
    gives 36864 and 30720, ties (away from zero: 40960, 32768; torch's conversion, to
    even, gives 32768, 32768), 64000 saturates to 57344, 12800 rounds to 12288; scale
    2**22 makes 200 a subnormal (3 * 2**-16); every backend gives the reference's bytes."""
    cases = [(2.0**-6, None, None), (2.0**22, None, None), (2.0**-20, None, None)]
    _agree(_every_backend(tmp_path, SUMS_E5M2, cases), SUMS_E5M2, cases)

    def values(scale: float, step: str) -> list[float]:
        got = _reference(SUMS_E5M2, scale, None)[0][step][:4]
        return torch.tensor(got, dtype=torch.uint8).view(torch.float8_e5m2).float().tolist()

    assert values(2.0**-6, "sum") == [40960.0, 32768.0, 57344.0, 12288.0]
    assert values(2.0**-6, "top") == [20480.0, 16384.0, 32768.0, 6144.0]  # 18432: a tie
    assert values(2.0**22, "sum")[3] == 3 * 2.0**-16
    assert values(2.0**-20, "rsum") == [57344.0] * 4  # rank 0's part: saturated
    assert values(2.0**-6, "comb") == values(2.0**-6, "sum")  # 2 * x, as the sum


ZERO_STEPS = """\
schedule: zeros
sizes:
  N: 4
buffers:
  x:    {shape: [N, 4], dtype: f32}
  s:    {shape: [1], dtype: f32}
  ar:   {shape: [N, 4], dtype: f32}
  mx:   {shape: [N, 4], dtype: f32}
  rd:   {shape: [N, 4], dtype: f32}
  rs:   {shape: [N/W, 4], dtype: f32}
  q:    {shape: [W, N/W, 4], dtype: fp8e4m3, symmetric: true}
  rs8:  {shape: [N/W, 4], dtype: fp8e4m3}
steps:
  - make:  {op: external, writes: [x, s]}
  - sum:   {op: all_reduce, src: x, dst: ar}
  - top:   {op: all_reduce, src: x, dst: mx, reduce: max}
  - red:   {op: reduce, src: x, dst: rd}
  - rsum:  {op: reduce_scatter, src: x, dst: rs, dim: 0}
  - quant: {op: all_to_all, src: x, dst: q, dim: 0, scale: {per: tensor, buffer: s}}
  - rs8:   {op: reduce_scatter, src: x, dst: rs8, dim: 0, output_scale: s}
  - use:   {op: external, reads: [ar, mx, rd, rs, q, rs8]}
  - release: {op: barrier}
"""
# per rank: column 0 -0 on both, 1 -0 then +0, 2 +0 then -0, 3 a negative below e4m3's
# smallest step (it rounds to zero)
ZEROS = [[[-0.0, -0.0, 0.0, -1e-4]] * 4, [[-0.0, 0.0, -0.0, -1e-4]] * 4]


def test_zeros_have_one_sign_on_every_backend(tmp_path: Path) -> None:
    """A sum of -0s is +0 (sums start at +0, as torch.sum and the kernels), a max of -0
    and +0 is +0 in either order (IEEE maximum), a -0.0 or a negative that rounds to
    zero quantises to -0 (e4m3 0x80, as a conversion does): host, local and torch give
    the reference's bits."""
    cases = [(1.0, ZEROS, None)]
    _agree(_every_backend(tmp_path, ZERO_STEPS, cases), ZERO_STEPS, cases)
    want = _reference(ZERO_STEPS, 1.0, ZEROS)[0]
    negative_zero = -2**31  # the f32 bits of -0.0
    assert want["sum"][:4] == [0, 0, 0, _bits(torch.tensor([-2e-4]))[0]]
    assert want["top"][:4] == [negative_zero, 0, 0, _bits(torch.tensor([-1e-4]))[0]]
    assert want["quant"][:4] == [0x80, 0x80, 0x00, 0x80]
    assert want["rs8"][:4] == [0x00, 0x00, 0x00, 0x80]


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_the_reference_refuses_a_bad_scale(scale: float) -> None:
    with pytest.raises(ValueError, match=r"simulator: rank 0's output_scale 's' is "):
        _reference(SUMS, scale, None)


def test_a_scale_above_2_126_is_refused_its_inverse_is_no_normal() -> None:
    """1 / s of s above 2**126 is an f32 denormal on the CPU and 0 on a GPU (div.rn.ftz):
    refused, as a denormal scale is; 2**-126 and 2**126 themselves are scales."""
    from dcpc.numerics import SCALE_MAX, SCALE_MIN, ieee_div, scale_fault

    above = torch.nextafter(torch.tensor(SCALE_MAX), torch.tensor(math.inf))
    assert scale_fault(float(above)) == "above 2**126: its inverse is no normal f32"
    assert scale_fault(SCALE_MAX) is None and scale_fault(SCALE_MIN) is None
    assert ieee_div(1.0, above).item() < SCALE_MIN <= ieee_div(1.0, SCALE_MAX).item()


def test_bad_scales_are_refused_on_every_backend(tmp_path: Path) -> None:
    """Every bad scale on the first scaled step, and a zero scale on each scaled step:
    DcpcScaleError naming step, rank and value, on host and local (W=2) and torch (W=1
    for every case, W=2 for the first: a failed rank's notices break its gloo pairs)."""
    cases = [(s, None, "sum") for s in BAD_SCALES]
    cases += [(0.0, None, step) for step in OUTPUTS if step not in ("sum", "sum8")]
    got = _every_backend(tmp_path, SUMS, cases)
    cls = _class(str(compile_text(SUMS, tmp_path, (1, 2))))
    for k, (scale, rows, step) in enumerate(cases):
        m = cls(None, sizes={}, device="cpu", backend="torch")
        got[0][f"torch1/{k}"] = _calls(m, 0, scale, rows, step)
        m.close()
    for k, (scale, _, step) in enumerate(cases):
        for backend in ("host", "local", "torch", "torch1"):
            if backend == "torch" and k:
                continue
            own = 0
            for rank in range(1 if backend == "torch1" else 2):
                kind, message = got[rank][f"{backend}/{k}"]["error"]
                if kind == "DcpcPeerFailedError":  # its peer raised first (a kernel checks
                    # the scale after the exchange): that peer's flag stopped this rank's
                    # wait, never data; the peer's own error is the scale's
                    assert message.startswith(f"step '{step}': rank {rank} stopped waiting "
                                              f"for peer {1 - rank}"), message
                    continue
                own += 1
                assert kind == "DcpcScaleError", (backend, k, message)
                assert message.startswith(f"step '{step}': rank {rank}'s fp8 scale is "
                                          f"{torch.tensor(scale).item()!r} ("), message
            assert own >= 1, (backend, k)  # at least one rank names the scale itself


# ---- merges and casts read their scales through the same check ---------------------------


MERGES = """\
schedule: merges
sizes:
  T: 4
  G: 2
  D: 8
buffers:
  o:     {shape: [W, T, G, D], dtype: f32}
  lse:   {shape: [W, T, G], dtype: f32, lse_base: e}
  o_own: {shape: [T, G, D], dtype: f32}
  s:     {shape: [1], dtype: f32}
  out:   {shape: [T, G, D], dtype: fp8e4m3}
  cor:   {shape: [T, G, D], dtype: fp8e4m3}
steps:
  - make:    {op: external, writes: [o, lse, o_own, s]}
  - merge:   {op: lse_combine, src: [o, lse], dst: out, output_scale: s}
  - correct: {op: lse_correct, src: [o_own, lse], dst: cor, output_scale: s}
  - use:     {op: external, reads: [out, cor]}
"""
CASTS = """\
schedule: casts
sizes:
  R: 4
  H: 8
buffers:
  x:  {shape: [R, H], dtype: f32}
  q:  {shape: [R, H], dtype: fp8e4m3}
  q2: {shape: [W, R/W, H], dtype: fp8e4m3, symmetric: true}
  y:  {shape: [W, R/W, H], dtype: f32, symmetric: true}
  s:  {shape: [1], dtype: f32}
steps:
  - make:  {op: external, writes: [x, q, s]}
  - quant: {op: all_to_all, src: x, dst: q2, dim: 0, scale: {per: tensor, buffer: s}}
  - back:  {op: all_to_all, src: q, dst: y, dim: 0, scale: {per: tensor, buffer: s}}
  - use:   {op: external, reads: [q2, y]}
  - release: {op: barrier}
"""


@pytest.mark.parametrize("backend", ["host", "torch"])
def test_merges_and_casts_refuse_bad_scales(tmp_path: Path, backend: str) -> None:
    """W=1: lse_combine, lse_correct and both per-tensor casts refuse each bad scale by
    step; a good scale passes."""
    merges = _class(str(compile_text(MERGES, tmp_path, (1,))))
    casts = _class(str(compile_text(CASTS, tmp_path, (1,))))
    o, lse = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2)
    x, q = torch.randn(4, 8), torch.randn(4, 8).to(torch.float8_e4m3fn)
    one = torch.tensor([1.0])
    calls = [(merges, "merge", [], lambda m, s: m.merge(o, lse, s)),
             (merges, "correct", [lambda m: m.merge(o, lse, one)],
              lambda m, s: m.correct(o[0], lse, s)),
             (casts, "quant", [], lambda m, s: m.quant(x, s)),
             (casts, "back", [lambda m: m.quant(x, one)], lambda m, s: m.back(q, s))]
    from dcpc.runtime import DcpcScaleError

    for cls, step, before, call in calls:
        for scale in [*BAD_SCALES, 1.0]:
            m = cls(None, sizes={}, device="cpu", backend=backend)
            try:
                for earlier in before:  # the contract's order: the steps before it first
                    earlier(m)
                if scale == 1.0:
                    assert not call(m, torch.tensor([scale])).float().isnan().any()
                    continue
                with pytest.raises(DcpcScaleError, match=rf"^step '{step}': rank 0's fp8 "
                                                         "scale is "):
                    call(m, torch.tensor([scale]))
            finally:
                m.close()


def test_dcpc_runs_synthetic_scales_are_positive_normals() -> None:
    """`dcpc run` draws every per-tensor scale (an output_scale, a cast's per: tensor
    buffer) as a scale, whether an engine input or written by an engine step: before,
    those drew randn, and half the runs of a per-tensor cast now refuse the scale."""
    from dcpc.harness import synth
    from dcpc.numerics import scale_fault

    text = CASTS.replace("writes: [x, q, s]", "writes: [x, q]")  # s: an engine input
    for source, written in ((text, False), (CASTS, True), (SUMS, True)):
        schedule = parse_text(source, "s.yaml")
        step = next(s for s in schedule.step_list() if s.name == "make")
        sizes = {"R": 4, "H": 8, "N": 4, "W": 2}
        for seed in range(20):
            if written:
                value = synth.make_external(schedule, 2, sizes, seed, 0)(step, 0, {})["s"]
            else:
                value = synth.call_inputs(schedule, 2, sizes, seed, 0)[0]["s"]
            assert scale_fault(float(value.float()[0])) is None, (source[:20], seed, value)


@pytest.mark.parametrize(("dtype", "acc", "want"), [
    ("fp8e4m3", 7.124999523162842, 2.5), ("fp8e5m2", 0.00011444091069279239, 2.0**-15 * 1.5)])
def test_the_reference_quantises_as_the_kernels_do(dtype: str, acc: float, want: float) -> None:
    """output_scale in the float64 reference: fl32(acc) * fl32(1 / s) rounded, the kernels'
    (and the torch backend's) rule; it computed acc / s (e4m3, s = 3: 2.25 for the
    kernels' 2.5; e5m2: 31 such accumulators near the grid's midpoints)."""
    from types import SimpleNamespace

    from dcpc.runtime.merge import quantize
    from dcpc.runtime.validate import DTYPES

    s = torch.tensor([3.0])
    value = torch.tensor([acc, -acc], dtype=torch.float64)
    ref = simulate.scaled(SimpleNamespace(output_scale="s"), {"s": s}, value, 0, dtype)
    assert ref.tolist() == [want, -want]
    assert quantize(value.float(), s, DTYPES[dtype]).double().tolist() == [want, -want]
    from dcpc.numerics import round_fp8

    assert round_fp8(value / 3.0, dtype).tolist() != [want, -want]  # the quotient: apart
