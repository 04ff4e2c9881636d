"""DeepEP's fp8 quantisation (``scale: {per: token, ..., rule: deepep}`` and ``rule:
deepep_round_scale``, dcpc/ops/cast.py, dcpc.numerics.token_scales): the rule against
float64 and bit-level references of its own (an fp8 grid enumerated from the format's
bytes, ties to the even byte; DeepEP's calculate_fp8_scales in float64 and frexp), on
ties, values past the range, NaN, inf, -0, subnormals and random rows; the verifier (a
rule on a cast that makes no scale: ``bad-scale``; a name not a rule: ``bad-value``,
located); and the kernels (ranks as threads: the ``local`` backend, the Triton
interpreter) and the torch backend bit for bit to the float64 reference on rows of
ties. schedules/ops/ragged_all_to_all_fp8_deepep.yaml runs against float64 at W = 2, 3,
4 on the host backend (tests/ops/test_op_schedules.py), and here on torch and local.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import child_result
from support.schedules import error_marks, ragged_cast, run_ranks

from dcpc.numerics import (
    FP8_FORMATS,
    SCALE_RULES,
    RuleProps,
    ScaleRule,
    inverse_top,
    round_fp8,
    token_scales,
)

INF, NAN = math.inf, math.nan
TORCH_FP8 = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def grid(fp8: str) -> np.ndarray:
    """The format's non-negative finite values by byte (0x00 up to the largest finite:
    byte i is the i-th value, so an even byte is an even mantissa)."""
    top = FP8_FORMATS[fp8][0]
    values = torch.arange(128, dtype=torch.uint8).view(TORCH_FP8[fp8]).double().numpy()
    return values[np.isfinite(values) & (values <= top)]


def nearest_even(y: np.ndarray, fp8: str) -> np.ndarray:
    """float64 ``y`` clamped to +-top and rounded to the nearest value of the grid, a tie
    to the even byte; the sign of a zero kept, NaN NaN: the bit-level reference."""
    g = grid(fp8)
    a = np.minimum(np.abs(y), g[-1])
    hi = np.clip(np.searchsorted(g, a), 0, len(g) - 1)
    lo = np.maximum(hi - 1, 0)
    below, above = a - g[lo], g[hi] - a
    pick = np.where(below < above, lo, np.where(above < below, hi,
                                                np.where(lo % 2 == 0, lo, hi)))
    r = np.copysign(g[pick], y)
    return np.where(np.isnan(y), np.nan, r)


def ties(fp8: str) -> np.ndarray:
    """Every value halfway between two neighbours of the grid, both signs (subnormal
    ones and the top's too), in fp32 exactly (each is a grid value plus half a step)."""
    g = grid(fp8)
    mid = (g[:-1] + g[1:]) / 2
    assert bool((mid.astype(np.float32) == mid).all())
    return np.concatenate([mid, -mid])


@pytest.mark.parametrize("fp8", list(FP8_FORMATS))
def test_ties_to_even_match_the_grid_reference(fp8: str) -> None:
    top = FP8_FORMATS[fp8][0]
    gen = np.random.default_rng(7)
    wide = gen.standard_normal(4000) * np.exp2(gen.integers(-30, 20, 4000))
    edge = [top * 1.01, -top * 3, INF, -INF, NAN, -0.0, 0.0, 2.0**-149, -(2.0**-140),
            1e-30, top - 1.0, 2.0 ** FP8_FORMATS[fp8][2] * 0.75]
    y = np.concatenate([ties(fp8), wide, edge]).astype(np.float32).astype(np.float64)
    got = round_fp8(torch.from_numpy(y).float(), fp8, even=True).double().numpy()
    want = nearest_even(y, fp8)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want) & ~np.isnan(want))
    # the default rule rounds a tie away from zero: the ties above are ties
    away = round_fp8(torch.from_numpy(ties(fp8)).float(), fp8).double().numpy()
    half = ties(fp8)
    assert bool((np.abs(away) > np.abs(half)).all())
    assert not np.array_equal(away, nearest_even(half, fp8))
    # and torch's own conversion (to nearest even) agrees inside the range
    inside = np.clip(y[np.isfinite(y)], -top, top)
    conv = torch.from_numpy(inside).float().to(TORCH_FP8[fp8]).double().numpy()
    assert np.array_equal(conv, nearest_even(inside, fp8))


def deepep_scales(rows: np.ndarray, group: int, rule: ScaleRule, top: float = 448.0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """DeepEP's calculate_fp8_scales in float64 (csrc/kernels/legacy/utils.cuh): amax of
    each group with fmaxf from kFP8Margin (a NaN skipped), scale_inv = fl32(amax *
    fl32(1 / 448)) (the float64 product of two f32 is exact: one rounding), scale =
    fl32(448 / amax) (double rounding from float64 is innocuous for a quotient of f32);
    round_scale: 2**e and 2**-e, e = ceil(log2(scale_inv)) by frexp."""
    f32 = np.float32
    amax = np.full(rows.shape[:-1] + (rows.shape[-1] // group,), float(f32(1e-4)))
    for k in range(rows.shape[-1] // group):
        part = np.abs(rows[..., k * group:(k + 1) * group])
        part = np.where(np.isnan(part), 0.0, part)
        amax[..., k] = np.maximum(amax[..., k], part.max(axis=-1))
    scale = (amax * float(f32(1.0) / f32(top))).astype(f32).astype(np.float64)
    with np.errstate(divide="ignore"):
        inverse = (top / amax).astype(f32).astype(np.float64)
    if rule == "deepep":
        return scale, inverse
    e = np.zeros(scale.shape, dtype=np.int64)
    for i, s in np.ndenumerate(scale):
        if math.isinf(s):
            e[i] = 128  # the exponent byte 0xFF: DeepEP's bits give scale inf, inverse -inf
            continue
        m, x = math.frexp(s)
        e[i] = x - 1 if m == 0.5 else x
    pow2 = np.vectorize(lambda k: math.ldexp(1.0, int(k)) if k < 128 else INF)
    return pow2(e), np.where(e == 128, -INF, pow2(-e))


def edge_rows(h: int, g: int, fp8: str = "fp8e4m3") -> torch.Tensor:
    """Rows [8, h] (bf16 values) whose groups hold ties of ``fp8``'s grid after the
    scaling, past-range values, a NaN, an inf, zeros, -0, subnormal ties and random
    values."""
    gen = torch.Generator().manual_seed(h + g)
    magnitude = torch.exp2(torch.randint(-12, 14, (8, h // g), generator=gen).float())
    x = torch.randn(8, h, generator=gen) * magnitude.repeat_interleave(g, dim=-1)
    tie = torch.tensor([8.5, 9.5, -8.5, -9.5, 232.0, 3 * 2.0**-10, -(2.0**-10), 0.53125])
    if fp8 == "fp8e5m2":  # amax 448: inverse 57344 / 448 = 128 (deepep), and 32 on row 1
        tie = torch.tensor([9.0, 11.0, -9.0, -11.0, 1152.0, 3 * 2.0**-17, -(2.0**-17),
                            0.5625]) / 128.0  # (round_scale, 2**-5): ties of e5m2's grid
    x[0, :g] = 1.0
    x[0, 0] = 448.0  # amax 448: the values * 1 (deepep), ties as they are
    x[0, 1:9] = tie
    x[1, :g] = 0.0
    x[1, 1] = -0.0
    x[1, 2:10] = tie * 4.0  # amax 928: a power-of-two scale rounds them to ties
    x[1, 10] = 928.0
    x[2, 1] = NAN  # skipped by the amax: only its own value NaN
    x[3, g - 1] = -INF  # scale inf, the others 0, the inf NaN (deepep)
    x[4, :g] = 0.0  # the floor
    x[5, :g] = torch.linspace(-3072.0, 2000.0, g)  # past 448
    x[6, :g] = 1e-7  # below the floor: tiny values, a subnormal grid
    return x.bfloat16().float()


@pytest.mark.parametrize("rule", ["deepep", "deepep_round_scale"])
@pytest.mark.parametrize(("h", "g"), [(256, 128), (128, 128), (64, 16)])
def test_scales_and_values_match_deepeps_rule_in_float64(rule: ScaleRule, h: int,
                                                         g: int) -> None:
    x = edge_rows(h, g)
    scale, inverse = token_scales(x, "fp8e4m3", g, rule)
    want_scale, want_inverse = deepep_scales(x.double().numpy(), g, rule)
    assert np.array_equal(scale.double().numpy(), want_scale)
    assert np.array_equal(inverse.double().numpy(), want_inverse)
    y = (x.float() * inverse.repeat_interleave(g, dim=-1)).double().numpy()  # fp32 product
    q = round_fp8(x.float() * inverse.repeat_interleave(g, dim=-1), "fp8e4m3", True)
    assert np.array_equal(q.double().numpy(), nearest_even(y, "fp8e4m3"), equal_nan=True)
    assert math.isnan(q[2, 1]) and bool(q[2, :g].isnan().sum() == 1)  # a NaN: its value
    if rule == "deepep":  # amax 448: a scale of about 1, the values as they are, rounded
        assert float(inverse[0, 0]) == 1.0
        assert q[0, 1:9].tolist() == [8.0, 10.0, -8.0, -10.0, 224.0, 2.0**-8, -0.0, 0.5]
        assert float(scale[0, 0]) == float(np.float32(448.0) * np.float32(1 / 448.0))
    else:  # powers of two, 928 / 448 -> 2**2
        assert float(scale[1, 0]) == 4.0 and float(inverse[1, 0]) == 0.25
        assert q[1, 2:10].tolist() == [8.0, 10.0, -8.0, -10.0, 224.0, 2.0**-8, -0.0, 0.5]
        m = torch.frexp(scale[scale.isfinite()]).mantissa
        assert bool((m == 0.5).all())
    if h // g > 1:  # the other groups keep their own (finite) scales
        assert bool(scale[:3, 1:].isfinite().all())


def test_the_default_rule_is_unchanged() -> None:
    """``rule`` left out is dcpc's: a NaN's group NaN, amax / 448 divided, ties away."""
    x = edge_rows(256, 128)
    scale, inverse = token_scales(x, "fp8e4m3", 128)
    amax = x.abs().reshape(8, 2, 128).amax(-1).clamp(min=1e-4).double()
    assert np.array_equal(scale.double().numpy(),
                          (amax / 448.0).float().double().numpy(), equal_nan=True)
    assert math.isnan(scale[2, 0])
    assert SCALE_RULES["dcpc"] == RuleProps(skips_nan=False, scale="divide", even=False)


def test_the_rules_properties_drive_the_scales() -> None:
    """token_scales reads SCALE_RULES' properties, not the names: deepep's scale is
    amax times inverse_top (fl32(1 / top)), its NaN skipped; e5m2's inverse_top too."""
    assert inverse_top("fp8e4m3") == float(np.float32(1.0) / np.float32(448.0))
    assert inverse_top("fp8e5m2") == float(np.float32(1.0) / np.float32(57344.0))
    x = edge_rows(256, 128)
    for rule, props in SCALE_RULES.items():
        scale, _ = token_scales(x, "fp8e5m2", 128, rule)
        assert math.isnan(scale[2, 0]) != props.skips_nan, rule
        finite = scale[4, 0]  # the floor: 1e-4 scaled by each rule's scale
        want = {"divide": float(np.float32(np.float32(1e-4) / np.float32(57344.0))),
                "multiply": float(np.float32(1e-4) * np.float32(inverse_top("fp8e5m2"))),
                "pow2": 2.0 ** math.ceil(math.log2(float(np.float32(1e-4) * np.float32(
                    inverse_top("fp8e5m2")))))}[props.scale]
        assert float(finite) == want, rule


def test_the_kernel_ab_diag_kernel_runs_on_the_interpreter() -> None:
    """benchmarks/diag/grouped_cast_a2a/kernel_ab.py calls _dcpc_round_fp8 without EVEN
    (its default, ties away): its direct-store case is clean under the interpreter."""
    from benchmarks.diag.grouped_cast_a2a.kernel_ab import one

    for fp8 in FP8_FORMATS:
        wrong, why = one(5, 128, torch.float32, fp8, 4, 4, True, "cpu")
        assert wrong == 0, why


def text(**kw: Any) -> str:
    """The ragged cast by DeepEP's rule (C at most 8), ``kw`` changed."""
    return ragged_cast(**{"cap": 8, "rule": "deepep", **kw})


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"rule": "deepep_round_scale"}, []),
    ({"rule": "dcpc"}, []),
    ({"group": None, "s_shape": "[W, C]"}, []),
    ({"rule": "ue8m0"}, [("bad-value", 11, 60)]),  # not a rule: the parser's enum
    ({"rule": "1"}, [("bad-value", 11, 60)]),
    ({"per": "tensor", "group": None, "s_shape": "[1]", "s_sym": False, "reads": "[y, m]"},
     [("bad-scale", 11, 49)]),  # per tensor makes no scale
    ({"src": "fp8e4m3", "dst": "f16", "s_sym": False, "reads": "[y, m]"},
     [("bad-scale", 11, 60)]),  # a dequantise neither
])
def test_verifier(change: dict[str, Any], want: list[tuple[str, int, int]],
                  tmp_path: Path) -> None:
    """Located at the step's ``rule``."""
    assert error_marks(text(**change), tmp_path, "cast.yaml") == want


def _child() -> None:
    """Quantise per token by each DeepEP rule, per 128 channels (H = 256) and per row
    (H = 128: the kernel's row tile), W = 2, rows of ties: the kernel's bytes and scales
    vs the float64 reference, the independent one above and the torch backend's call."""
    import tempfile

    from dcpc.harness.simulate import simulate_call
    from dcpc.lang.parse import parse_text
    from dcpc.runtime import collectives

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a.double().isnan(), b.double().isnan())) and bool(
            torch.equal(torch.nan_to_num(a.double()), torch.nan_to_num(b.double()))) and bool(
            torch.equal(a.double().signbit() & ~a.double().isnan(),
                        b.double().signbit() & ~b.double().isnan()))

    world, cap = 2, 8
    out: dict[str, Any] = {}
    cases = [(rule, h, g, "fp8e4m3") for rule in ("deepep", "deepep_round_scale")
             for h, g in ((256, 128), (128, None))]
    cases += [(rule, 256, 128, "fp8e5m2") for rule in ("deepep", "deepep_round_scale")]
    for rule, h, g, fp8 in cases:
        groups = h // (g or h)
        source = text(h=h, rule=rule, group=g, dst=fp8,
                      s_shape=f"[W, C, {groups}]" if g else "[W, C]")
        xs = [edge_rows(h, g or h, fp8).reshape(1, cap, h).repeat(world, 1, 1).bfloat16()
              for _ in range(world)]
        xs[1] = xs[1].flip(1)  # rank 1 sends the rows in the other order
        counts = [torch.full((world,), cap, dtype=torch.int32) for _ in range(world)]
        counts[1][0] = 6  # a ragged block
        def body(inst: Any, rank: Any, xs: list = xs, counts: list = counts) -> Any:
            y, _ = inst.move(xs[rank.rank], counts[rank.rank])
            s = inst.buffer("s", 0, {"C": cap}).clone()
            y = y.clone()
            rank.barrier()
            return y, s

        with tempfile.TemporaryDirectory(prefix="dcpc-deepep-") as tmp:
            got = run_ranks(source, Path(tmp), world, {"C": cap}, body)
        inputs = [{"x": xs[p].double(), "n": counts[p].long()} for p in range(world)]
        ref = simulate_call(parse_text(source), world, {"C": cap, "H": h}, inputs,
                            lambda step, r, bufs: {})
        exact = independent = torch_exact = True
        for j in range(world):
            assert isinstance(got[j], tuple), got[j]  # run_ranks: a rank's error as text
            y, s = got[j]
            for p in range(world):
                n = int(counts[p][j])
                rows = xs[p][j, :n].float()
                sc, inv = deepep_scales(rows.double().numpy(), g or h, rule,  # type: ignore[arg-type]
                                        FP8_FORMATS[fp8][0])
                scaled = rows * torch.from_numpy(inv).float().repeat_interleave(g or h, -1)
                q = torch.from_numpy(nearest_even(scaled.double().numpy(), fp8))
                s_row = s[p, :n].reshape(n, groups)
                exact &= same(y[p, :n], ref[j]["y"][p, :n]) and same(s[p, :n],
                                                                      ref[j]["s"][p, :n])
                independent &= same(y[p, :n].double(), q) and same(
                    s_row.double(), torch.from_numpy(sc))
                dst = torch.zeros(1, cap, h, dtype=y.dtype)
                sent = torch.zeros(1, *s.shape[1:])
                collectives.ragged_all_to_all(
                    collectives.SlotGroup(None, 0, 0, None), xs[p][j:j + 1],
                    counts[p][j:j + 1], dst, torch.zeros(1, dtype=torch.int32), cap, 1,
                    "move", 1, sent, group=g, rule=rule)
                torch_exact &= same(dst[0, :n], ref[j]["y"][p, :n]) and same(
                    sent[0, :n], ref[j]["s"][p, :n])
        out[f"{rule}/{h}/{fp8}"] = {"exact": exact, "independent": independent,
                                    "torch": torch_exact}
    print("RESULT " + json.dumps(out))


@pytest.mark.e2e
def test_kernels_and_torch_are_deepeps_rule_bit_for_bit() -> None:
    result = child_result(__file__, "deepep")
    want = {"exact": True, "independent": True, "torch": True}
    cases = [f"{r}/{h}/fp8e4m3" for r in ("deepep", "deepep_round_scale") for h in (256, 128)]
    cases += [f"{r}/256/fp8e5m2" for r in ("deepep", "deepep_round_scale")]  # e5m2's ties
    assert result == {case: want for case in cases}, result


OP_FILE = Path(__file__).resolve().parents[2] / "schedules/ops/ragged_all_to_all_fp8_deepep.yaml"


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [(3, "torch"), (2, "local")], ids=str)
def test_the_op_file_matches_float64_on_torch_and_local(world: int, backend: str) -> None:
    """Every output and both scale buffers, every call, bit for bit."""
    from support.schedules import run_clean

    report, text = run_clean(schedule=str(OP_FILE), world=world, backend=backend, calls=4,
                             seed=3, programs=2)
    for name in ("q_recv", "s_recv", "y_back", "q_row", "s_row", "q", "s", "y", "q64", "s64"):
        stats = report.outputs[name]  # type: ignore[attr-defined]
        assert stats.compared == 4 * world and stats.max_abs_err == 0.0, (name, text)


if __name__ == "__main__" and sys.argv[1:] == ["deepep"]:
    _child()
