"""The grouped fp8 cast's quantise-and-store, alone in one kernel, on every tile shape.

    python3 -m benchmarks.diag.grouped_cast_a2a.kernel_ab [--device cuda]

One program per launch loads a ``[BLOCK_R, G]`` tile of rows (f32 or bf16), takes each
row's amax, quantises with ``_dcpc_quantize`` and stores through ``_dcpc_store_fp8``
(dcpc/runtime/device.py): the lines of the ragged template's grouped cast (cast 1, the
``group`` path), with no communication. The bytes are compared with
``dcpc.numerics.round_fp8`` (the one rule) bit for bit, for BLOCK_R in 1..16, num_warps
1..8, G 128/256, e4m3/e5m2, and a variant that stores the conversion directly
(``tl.store(fp8_ptr, r.to(fp8))``, no byte path). One line per case: its mismatches and
which rows/columns they fall on. Prints ``ALL CLEAN`` or ``FAILURES n``.

The ``peer`` cases (first; ``--cases peer`` runs them alone, a few seconds) store as the
ragged template does: the destination and scale pointers read from a table (a peer's, so
Triton knows no alignment and stores one byte a thread), int64 rows, the column mask
``c < row_len`` at run time. On sm_90 the [8, 128] f32 tile on 4 warps then converts its
bytes to the store's layout through shared memory in byte pairs (``st.shared.v2.b8``);
each peer line says ``byte-pairs`` when its compiled PTX has them (dcpc.harness.ptx's
byte-pair-shared-store) and ``fp8_tile`` on the shape ScheduleModule._fp8_tile launches
(the fix: one row's vector a thread). README.md, last section.
"""

from __future__ import annotations

import argparse
import itertools
import re

import torch
import triton
import triton.language as tl

from dcpc.numerics import FP8_FORMATS, round_fp8, token_scales
from dcpc.runtime.device import _dcpc_quantize, _dcpc_round_fp8, _dcpc_store_fp8
from dcpc.runtime.module import ScheduleModule, Tune

TORCH_FP8 = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


@triton.jit
def _cast_tile(src, dst, scale, rows, G: tl.constexpr, BLOCK_R: tl.constexpr,
               DIRECT: tl.constexpr, TOP: tl.constexpr, MANTISSA: tl.constexpr,
               MIN_EXP: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = r < rows
    at = r.to(tl.int64) * G
    c = tl.arange(0, G)
    m = mr[:, None] & (c < G)[None, :]
    vals = tl.load(src + at[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(vals), axis=1), 1e-4)
    tl.store(scale + r, tl.math.div_rn(amax, TOP), mask=mr)
    vals = _dcpc_quantize(vals, tl.math.div_rn(TOP, amax)[:, None])
    if DIRECT:
        q = _dcpc_round_fp8(vals, TOP, MANTISSA, MIN_EXP)
        tl.store(dst + at[:, None] + c[None, :], q.to(dst.dtype.element_ty), mask=m)
    else:
        _dcpc_store_fp8(dst + at[:, None] + c[None, :], vals, m)


@triton.jit
def _cast_tile_peer(src, dst_ptrs, scale_ptrs, rows, row_len, G: tl.constexpr,
                    BLOCK_R: tl.constexpr, E5: tl.constexpr):
    """_cast_tile's quantise and store as ragged_all_to_all.py.j2's cast 1 with a group
    makes them: pointers from a table, int64 rows, a run-time column mask."""
    if E5:
        dst = tl.load(dst_ptrs).to(tl.pointer_type(tl.float8e5))
    else:
        dst = tl.load(dst_ptrs).to(tl.pointer_type(tl.float8e4nv))
    to = tl.load(scale_ptrs).to(tl.pointer_type(tl.float32))
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = r < rows
    at = r.to(tl.int64) * row_len
    for c0 in range(0, row_len, G):
        c = c0 + tl.arange(0, G)
        m = mr[:, None] & (c < row_len)[None, :]
        vals = tl.load(src + at[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(vals), axis=1), 1e-4)
        tl.store(to + r.to(tl.int64) * (row_len // G) + c0 // G,
                 tl.math.div_rn(amax, 448.0 if not E5 else 57344.0), mask=mr)
        vals = _dcpc_quantize(vals, tl.math.div_rn(448.0 if not E5 else 57344.0, amax)[:, None])
        _dcpc_store_fp8(dst + at[:, None] + c[None, :], vals, m)


def peer(rows: int, g: int, src_dtype: torch.dtype, fp8: str, block_r: int, warps: int,
         device: str) -> tuple[int, str]:
    """One ``peer`` case: (wrong bytes and scales, the line's detail)."""
    gen = torch.Generator().manual_seed(rows * 1000 + g + block_r * 7 + warps)
    x = (torch.randn(rows, g, generator=gen, dtype=torch.float64) * 3).to(src_dtype)
    s_ref, inv = token_scales(x.reshape(rows, 1, g), fp8)
    want = round_fp8(x.float() * inv.reshape(rows, 1), fp8).to(TORCH_FP8[fp8]).view(torch.uint8)
    src = x.to(device)
    dst = torch.full((rows, g), 0x55, dtype=torch.uint8, device=device).view(TORCH_FP8[fp8])
    scale = torch.full((rows,), float("nan"), device=device)
    table = torch.tensor([dst.data_ptr(), scale.data_ptr()], dtype=torch.int64, device=device)
    compiled = _cast_tile_peer[(triton.cdiv(rows, block_r),)](
        src, table, table[1:], rows, g, G=g, BLOCK_R=block_r, E5=fp8 == "fp8e5m2",
        num_warps=warps)
    ptx = getattr(compiled, "asm", {}).get("ptx", "") if device == "cuda" else ""
    pairs = len(re.findall(r"\bst\.shared\.v[24]\.b8\b", ptx))
    got = dst.view(torch.uint8).cpu()
    bad = (got != want).nonzero().tolist()
    scale_bad = int((scale.cpu().view(torch.int32) != s_ref.reshape(rows).view(torch.int32)).sum())
    where = f"byte-pairs {pairs}" if device == "cuda" else "byte-pairs n/a (no PTX)"
    if bad:
        bad_rows = sorted({b[0] for b in bad})
        where += (f"; rows {bad_rows[:16]} first got {int(got[bad[0][0], bad[0][1]]):#04x} "
                  f"want {int(want[bad[0][0], bad[0][1]]):#04x} at {bad[0]}")
    return len(bad) + scale_bad, f"scales {scale_bad} wrong; {where}"


def peer_cases(device: str) -> int:
    failures = 0
    tune = Tune(programs=1, num_warps=4, block=0)
    for rows, g, sd, fp8, (br, w) in itertools.product(
            [5, 16], [128, 256], [torch.float32, torch.bfloat16], ["fp8e4m3", "fp8e5m2"],
            [(8, 4), (4, 4), (2, 4), (8, 8), (16, 4), (1, 4)]):
        if device != "cuda" and (rows != 5 or sd != torch.float32):
            continue  # the interpreter ignores warps: a smoke test
        fixed = ScheduleModule._fp8_tile(tune, br, g, g)
        tag_fix = " fp8_tile" if w == 4 and (br, g, 4) == fixed else ""
        n, why = peer(rows, g, sd, fp8, br, w, device)
        failures += n > 0
        print(f"{'FAIL' if n else 'ok  '} peer rows {rows} G {g} {str(sd)[6:]} {fp8} "
              f"BLOCK_R {br} warps {w}{tag_fix}: {n} wrong; {why}", flush=True)
    return failures


def one(rows: int, g: int, src_dtype: torch.dtype, fp8: str, block_r: int, warps: int,
        direct: bool, device: str) -> tuple[int, str]:
    gen = torch.Generator().manual_seed(rows * 1000 + g + block_r * 7 + warps)
    x = (torch.randn(rows, g, generator=gen, dtype=torch.float64) * 3).to(src_dtype)
    top, mantissa, min_exp = FP8_FORMATS[fp8]
    s_ref, inv = token_scales(x.reshape(rows, 1, g), fp8)
    want = round_fp8(x.float() * inv.reshape(rows, 1), fp8).to(TORCH_FP8[fp8]).view(torch.uint8)
    src = x.to(device)
    dst = torch.full((rows, g), 0x55, dtype=torch.uint8, device=device).view(TORCH_FP8[fp8])
    scale = torch.full((rows,), float("nan"), device=device)
    _cast_tile[(triton.cdiv(rows, block_r),)](
        src, dst, scale, rows, G=g, BLOCK_R=block_r, DIRECT=direct, TOP=top,
        MANTISSA=mantissa, MIN_EXP=min_exp, num_warps=warps)
    got = dst.view(torch.uint8).cpu()
    bad = (got != want).nonzero().tolist()
    scale_bad = int((scale.cpu().view(torch.int32) != s_ref.reshape(rows).view(torch.int32)).sum())
    where = ""
    if bad:
        bad_rows = sorted({b[0] for b in bad})
        bad_cols = sorted({b[1] for b in bad})
        where = (f" rows {bad_rows[:16]} cols {bad_cols[:8]}..{bad_cols[-4:]} "
                 f"first got {int(got[bad[0][0], bad[0][1]]):#04x} "
                 f"want {int(want[bad[0][0], bad[0][1]]):#04x}")
    return len(bad) + scale_bad, f"scales {scale_bad} wrong" + where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", choices=["all", "peer", "tile"], default="all",
                    help="peer: the ragged template's store (first); tile: the 640 of before")
    args = ap.parse_args()
    if args.device == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__,
              "triton", triton.__version__)
    failures = peer_cases(args.device) if args.cases != "tile" else 0
    if args.cases == "peer":
        print("ALL CLEAN" if not failures else f"FAILURES {failures}")
        return
    cases = itertools.product([5, 16], [128, 256], [torch.float32, torch.bfloat16],
                              ["fp8e4m3", "fp8e5m2"], [1, 2, 4, 8, 16], [1, 2, 4, 8],
                              [False, True])
    for rows, g, sd, fp8, br, w, direct in cases:
        if args.device != "cuda" and (w != 4 or rows != 5):
            continue  # the interpreter ignores warps: a smoke test
        n, why = one(rows, g, sd, fp8, br, w, direct, args.device)
        failures += n > 0
        tag = "FAIL" if n else "ok  "
        print(f"{tag} rows {rows} G {g} {str(sd)[6:]} {fp8} BLOCK_R {br} warps {w} "
              f"{'direct' if direct else 'bytes '}: {n} wrong; {why}", flush=True)
    print("ALL CLEAN" if not failures else f"FAILURES {failures}")


if __name__ == "__main__":
    main()
