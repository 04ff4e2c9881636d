"""Issue 22 (no silent wrong data): NaN and +-inf in a quantising cast (dcpc/ops/cast.py).
The kernels (ranks as threads: the ``local`` backend, Triton's interpreter) and the torch
backend store the float64 reference's e4m3 and e5m2 bytes exactly: a NaN is the NaN byte
0x7F (the interpreter stored an fp32 NaN as e4m3's 0x7C = 384), a row with a NaN has a
NaN scale and every value NaN, a row with +-inf has an inf scale (its finite values 0,
the inf itself NaN); a tensor scale saturates +-inf to +-448 (e4m3) or +-57344 (e5m2),
and e5m2's subnormals (down to 2**-16) come out as the reference rounds them."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from support.kernels import run_ranks
from support.schedules import ragged_head

from dcpc.numerics import FP8_FORMATS, round_e4m3, round_fp8
from dcpc.ops.cast import quantise_rows
from dcpc.runtime.device import _dcpc_store_fp8
from dcpc.runtime.validate import DTYPES as TORCH_DTYPES

WORLD, CAP, H = 2, 4, 8
MOVE = ("  - move: {op: ragged_all_to_all, src: x, dst: y, counts: n, recv_counts: m, "
        "capacity: C,\n           scale: {per: PER, buffer: s}}\n")
MODE = {"token": 1, "tensor": 2}  # the kernel's CAST


def _inputs() -> list[torch.Tensor]:
    """Random rows; rows 0, 1, 2 of every block hold a NaN, a +inf, a -inf; row 3 is
    tiny (subnormal in either fp8 by the tensor scale) but for one value past 57344."""
    g = torch.Generator().manual_seed(22)
    xs = []
    for _ in range(WORLD):
        x = torch.randn(WORLD, CAP, H, generator=g) * 3
        x[:, 0, 3], x[:, 1, 5], x[:, 2, 0] = float("nan"), float("inf"), float("-inf")
        x[:, 3] *= 2.0**-20
        x[:, 3, 1], x[:, 3, 2] = -0.0, -7e4 * 0.05
        xs.append(x.bfloat16())
    return xs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits; a NaN scale (f32) only needs to be a NaN."""
    if got.dtype == torch.float32 and bool(got.isnan().any() | want.isnan().any()):
        return bool(torch.equal(got.isnan(), want.isnan())) and bool(
            torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)))
    return bool(torch.equal(_bits(got), _bits(want)))


def _reference(x: torch.Tensor, per: str, scale: torch.Tensor, fp8: str = "fp8e4m3"
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, sent = quantise_rows(x, per, scale, fp8)
    return q.float().to(TORCH_DTYPES[fp8]), None if sent is None else sent.float()


def test_round_e4m3_gives_one_nan() -> None:
    """inf * 0 is a negative NaN on x86 (0xFF as e4m3fn): the rule keeps the one NaN."""
    y = torch.tensor([float("inf"), float("-inf")]) * 0.0
    assert _bits(round_e4m3(y).to(torch.float8_e4m3fn)).tolist() == [0x7F, 0x7F]


@pytest.mark.parametrize("fp8", ["fp8e4m3", "fp8e5m2"])
@pytest.mark.parametrize("per", ["token", "tensor"])
def test_nonfinite_rows_quantise_to_the_references_bytes(per: str, fp8: str) -> None:
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime import collectives

    xs = _inputs()
    tensor_scale = torch.tensor([0.05])  # 448 * 0.05 = 22.4: big finite values saturate
    source = ragged_head("nonfinite", CAP, H, dst=fp8, s_shape="[W, C]" if per == "token"
                         else "[1]", s_sym=per == "token") + MOVE.replace("PER", per)
    with tempfile.TemporaryDirectory(prefix="dcpc-nonfinite-") as tmp:
        path = Path(tmp) / "nonfinite.yaml"
        path.write_text(source)
        _, module, _, _ = compile_to(str(path), Path(tmp), WORLD)

        def rank_main(rank: Any) -> Any:
            inst = load_module_class(module, "nonfinite")(rank, sizes={"C": CAP},
                                                          device="cpu", backend="local")
            counts = torch.full((WORLD,), CAP, dtype=torch.int32)
            args = [xs[rank.rank], counts] + ([tensor_scale] if per == "tensor" else [])
            y, _ = inst.move(*args)
            s = inst.buffer("s", 0, {"C": CAP}).clone() if per == "token" else None
            y = y.clone()
            rank.barrier()
            inst.close()
            return y, s

        got = run_ranks(WORLD, rank_main)
    bad = []
    for j in range(WORLD):
        y, s = got[j]
        for p in range(WORLD):
            want_q, want_s = _reference(xs[p][j], per, tensor_scale, fp8)
            if not _same(y[p], want_q):
                bad.append(("kernel", j, p, _bits(y[p][:3]).tolist(),
                            _bits(want_q[:3]).tolist()))
            if want_s is not None and not _same(s[p], want_s):
                bad.append(("kernel scale", j, p, s[p].tolist(), want_s.tolist()))
            # the torch backend's cast of the same block (W = 1: the collective copies)
            dst = torch.zeros(1, CAP, H, dtype=TORCH_DTYPES[fp8])
            sc = torch.zeros(1, CAP) if per == "token" else tensor_scale
            collectives.ragged_all_to_all(
                collectives.SlotGroup(None, 0, 0, None), xs[p][j : j + 1],
                torch.tensor([CAP], dtype=torch.int32), dst, torch.zeros(1, dtype=torch.int32),
                CAP, 1, "move", MODE[per], sc)
            if not _same(dst[0], want_q) or (want_s is not None and not _same(sc[0], want_s)):
                bad.append(("torch", j, p, _bits(dst[0][:3]).tolist()))
    assert not bad, bad
    # the rule itself: a NaN row is all NaN (per token); +-inf saturate (per tensor)
    want_q, _ = _reference(xs[0][0], per, tensor_scale, fp8)
    top = FP8_FORMATS[fp8][0]
    if per == "token":
        assert set(_bits(want_q[0]).tolist()) == {0x7F}
        assert _bits(want_q[1]).tolist()[5] == 0x7F
    else:
        assert want_q[1, 5].item() == top and want_q[2, 0].item() == -top
        assert _bits(want_q[0]).tolist()[3] == 0x7F
        assert want_q[3, 2].item() == -top and _bits(want_q[3]).tolist()[1] == 0x80
    if fp8 == "fp8e5m2":  # subnormals were drawn (|q| < 2**-14), on the 2**-16 grid
        tiny = want_q[3].float()[(want_q[3].float().abs() < 2.0**-14)
                                 & (want_q[3].float() != 0)]
        if per == "tensor":
            assert tiny.numel() > 0
        assert torch.equal(tiny, torch.round(tiny * 2.0**16) * 2.0**-16)


def test_an_fp8_merge_output_stores_nan_as_the_nan_byte(tmp_path: Path) -> None:
    """lse_combine's output_scale (templates/math.j2 _dcpc_merge_cols; reduce_scatter's
    uses the same store): a NaN partial of weight > 0 merges to NaN, byte 0x7F (the
    interpreter stored 0x7C = 384); +-inf saturates to +-448, like the reference."""
    from support.kernels import compile_text, load, merge_schedule

    from dcpc.runtime import merge

    world, t, g, dv = 4, 5, 3, 16
    mod = load(compile_text(merge_schedule("bf16", "e", False, False, 1, dv), tmp_path))
    gen = torch.Generator().manual_seed(3)
    o = (torch.randn(world, t, g, dv, generator=gen) * 2).bfloat16()
    o[0, 1, 0, 5], o[1, 2, 1, 6], o[2, 3, 2, 7] = float("nan"), float("inf"), float("-inf")
    lse = torch.randn(world, t, g, generator=gen) * 3
    dst = torch.zeros(t, g, dv, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([0.01])
    qsl = torch.tensor([0, t], dtype=torch.int32)
    errors = torch.zeros(8, dtype=torch.int32)  # the error record (a bad scale lands here)
    mod._merge_kernel[(t * g // 4 + 1,)](
        o, lse, dst, lse, torch.tensor([t], dtype=torch.int32), qsl, scale, errors, t * g, dv,
        g, 1, STEP=1, WORLD=world, INTERLEAVE=1, MASK=False, BASE2=False, RETURN_LSE=False,
        SCALE=True, SEARCH_STEPS=1, BLOCK_B=0, ROW_LEN=0, BLOCK_N=4, BLOCK_D=16)
    ref, _ = merge.lse_combine(o.double(), lse.double(), "e", None, torch.float64)
    want = round_e4m3((ref / 0.01).float())
    got = _bits(dst)
    assert not errors.any(), errors  # a good scale records nothing
    assert got[1, 0, 5].item() == 0x7F and int((got == 0x7F).sum()) == 1, got[1, 0]
    assert got[2, 1, 6].item() == _bits(torch.tensor([448.0]).to(dst.dtype)).item()
    assert dst[3, 2, 7].item() == -448.0
    finite = ~want.isnan()
    err = (dst.float() - want).abs()[finite] - 0.125 * want.abs()[finite]  # one e4m3 step
    assert err.max().item() <= 2.0**-9


RS = """\
schedule: rsfp8
sizes: {T: 4, H: 8}
buffers:
  x: {shape: [W*T, H], dtype: bf16}
  s: {shape: [1], dtype: f32}
  y: {shape: [T, H], dtype: fp8e4m3}
steps:
  - rs: {op: reduce_scatter, src: x, dst: y, output_scale: s}
"""


def test_an_fp8_reduce_scatter_stores_the_references_bytes(tmp_path: Path) -> None:
    """reduce_scatter's output_scale (templates/ops/reduce_scatter.py.j2): a NaN sums to
    NaN, byte 0x7F; +-inf saturates; every byte is round_e4m3 of the fp32 sum."""
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.numerics import ieee_div
    from dcpc.runtime.local import LocalGroup

    path = tmp_path / "rs.yaml"
    path.write_text(RS)
    _, module, _, _ = compile_to(str(path), tmp_path, WORLD)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(WORLD * 4, H, generator=gen).bfloat16() for _ in range(WORLD)]
    xs[0][1, 2], xs[1][2, 3], xs[1][6, 1] = float("nan"), float("inf"), float("-inf")
    scale = torch.tensor([0.01])

    def rank_main(rank: Any) -> torch.Tensor:
        inst = load_module_class(module, "rsfp8")(rank, sizes={}, device="cpu",
                                                  backend="local")
        y = inst.rs(xs[rank.rank], scale).clone()
        rank.barrier()
        inst.close()
        return y

    got = LocalGroup(WORLD, "cpu", timeout_s=60).run(rank_main)
    for j in range(WORLD):
        total = sum(x[j * 4 : (j + 1) * 4].float() for x in xs)
        want = round_e4m3(total * ieee_div(1.0, scale[0])).to(torch.float8_e4m3fn)
        assert torch.equal(_bits(got[j]), _bits(want)), (j, _bits(got[j]), _bits(want))
    assert _bits(got[0])[1, 2].item() == 0x7F and got[0][2, 3].item() == 448.0
    assert got[1][2, 1].item() == -448.0


WIDEN = """\
schedule: widen
sizes: {{C: 4, H: 64}}
buffers:
  q:  {{shape: [W*C, H], dtype: {fp8}}}
  s:  {{shape: {shape}, dtype: f32}}
  y:  {{shape: [W, C, H], dtype: {wide}, symmetric: true}}
steps:
  - widen: {{op: all_to_all, src: q, dst: y, scale: {{per: {per}, buffer: s}}}}
"""


@pytest.mark.parametrize("wide", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("per", ["token", "tensor"])
@pytest.mark.parametrize("fp8", ["fp8e5m2", "fp8e4m3"])
def test_every_fp8_byte_dequantises_as_the_reference(fp8: str, per: str, wide: str,
                                                     tmp_path: Path) -> None:
    """Every e5m2 byte (NaNs of each payload, +-inf, -0, subnormals, +-57344) and every
    e4m3 byte (its NaNs 0x7F and 0xFF, -0, subnormals, +-448) times its scale, on the
    kernels (the Triton 3.6 interpreter reads e5m2's inf and NaN as finite, 65536 ...,
    and e4m3's NaN bytes as +-480: _dcpc_widen reads the bits) and the torch backend: the
    reference's value (dcpc.ops.cast.dequantise_rows) rounded once into dst; a NaN stays
    NaN, an inf inf."""
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.ops.cast import dequantise_rows
    from dcpc.runtime import collectives

    gen = torch.Generator().manual_seed(7)
    qs = [torch.randperm(256, generator=gen).to(torch.uint8).repeat(WORLD).view(
        WORLD * 4, 64).view(TORCH_DTYPES[fp8]) for _ in range(WORLD)]
    # a power of two keeps every byte's value exact; 3 rounds (and overflows f16, bf16)
    ss = [torch.tensor([0.25]) if per == "tensor" else
          torch.tensor([0.25, 3.0, 2.0**-10, 1.0] * 2) for _ in range(WORLD)]
    path = tmp_path / "widen.yaml"
    path.write_text(WIDEN.format(shape="[1]" if per == "tensor" else "[W*C]", wide=wide,
                                 per=per, fp8=fp8))
    _, module, _, _ = compile_to(str(path), tmp_path, WORLD)

    def rank_main(rank: Any) -> torch.Tensor:
        inst = load_module_class(module, "widen")(rank, sizes={}, device="cpu",
                                                  backend="local")
        y = inst.widen(qs[rank.rank], ss[rank.rank]).clone()
        rank.barrier()
        inst.close()
        return y

    got = run_ranks(WORLD, rank_main)
    dtype = TORCH_DTYPES[wide]

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        nan = a.isnan()
        return bool(torch.equal(nan, b.isnan())) and bool(torch.equal(
            a.masked_fill(nan, 0).view(torch.int8), b.masked_fill(nan, 0).view(torch.int8)))

    for j in range(WORLD):
        for p in range(WORLD):
            rows = slice(j * 4, (j + 1) * 4)
            scale = ss[p] if per == "tensor" else ss[p][rows]
            want = dequantise_rows(qs[p][rows].float(), per, scale).to(dtype)
            assert same(got[j][p], want), (j, p)
            dst = torch.zeros(1, 4, 64, dtype=dtype)  # the torch backend, W = 1
            collectives.cast_all_to_all(collectives.SlotGroup(None, 0, 0, None),
                                        qs[p][rows], dst, 4, 1, 3 if per == "token" else 4,
                                        scale)
            assert same(dst[0], want), (j, p)
    q = qs[0].view(torch.uint8)
    if fp8 == "fp8e4m3":  # rank 1's block from rank 0 (its rows 4..7): its NaN bytes NaN
        assert {0x7F, 0xFF, 0x80, 0x01, 0x7E} <= set(q.flatten().tolist())
        nan = got[1][0].float()[(q[4:] & 0x7F) == 0x7F]
        assert bool(nan.isnan().all()) and nan.numel() > 0
        return
    assert {0x7D, 0x7E, 0x7F, 0x7C, 0xFC, 0x80, 0x01, 0x7B} <= set(q.flatten().tolist())
    inf = got[1][0].float()[q[4:] == 0x7C]  # rank 1's block from rank 0: its rows 4..7
    assert bool((inf == float("inf")).all()) and inf.numel() > 0


@triton.jit
def _store_fp8(src, dst, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    o = tl.arange(0, BLOCK)
    _dcpc_store_fp8(dst + o, tl.load(src + o), o < BLOCK)


def test_the_kernel_rounds_just_below_a_half_down() -> None:
    """x / ulp = 0.5 - 2**-25 (half the smallest subnormal less 2**-25 of a step): 0, -0
    and one step for 3x, the bytes of round_fp8 (floor(x + 0.5) stored 1 step)."""
    for fp8, v in (("fp8e4m3", 2.0**-10 - 2.0**-34), ("fp8e5m2", 2.0**-17 - 2.0**-41)):
        src = torch.tensor([v, -v, 3 * v, -3 * v])
        dst = torch.zeros(4, dtype=TORCH_DTYPES[fp8])
        _store_fp8[(1,)](src, dst, BLOCK=4)
        assert dst.view(torch.uint8).tolist() == [0x00, 0x80, 0x01, 0x81], fp8
        want = round_fp8(src, fp8).to(TORCH_DTYPES[fp8]).view(torch.uint8)
        assert torch.equal(dst.view(torch.uint8), want), fp8


def test_an_fp8_store_into_no_fp8_buffer_fails_at_compile() -> None:
    """_dcpc_store_fp8 picks the format by dst's type: e5m2, else e4m3, which it asserts
    (tl.static_assert), so a bf16 dst is an error, not bytes of e4m3 in it."""
    one = torch.full((4,), 1.5)

    def store(dst: torch.Tensor, BLOCK: int) -> None:  # noqa: N803
        _store_fp8[(1,)](one, dst, BLOCK=BLOCK)

    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        dst = torch.zeros(4, dtype=fp8)
        store(dst, BLOCK=4)
        assert dst.float().tolist() == [1.5] * 4
    with pytest.raises(Exception, match="AssertionError"):
        store(torch.zeros(4, dtype=torch.bfloat16), BLOCK=4)
