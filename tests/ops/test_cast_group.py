"""fp8 scales per G channels (``scale: {per: token, group: G, buffer: s}``: DeepEP's and
DeepSeek-V3's one scale per 128 channels, dcpc/ops/cast.py): the rule (each group cast
as a token of G channels would be: the per-token rule is its one-group case), the
verifier (a wrong ``s`` shape, a row that is no whole number of groups, a group that is
no power of two or per tensor: refused, located), and the kernels (ranks as threads:
the ``local`` backend on CPU) equal bit for bit to the torch backend and the float64
reference on rows with a group of zeros, NaN, inf and values past 448, at H = G and
H = 2G. schedules/ops/ragged_all_to_all_fp8_group.yaml runs against float64 at W = 2, 3,
4 on the host backend (tests/ops/test_op_schedules.py), and here on the torch backend
(W = 3) and the local one (W = 2).
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
from support.kernels import run_ranks
from support.schedules import error_marks, ragged_cast

from dcpc.numerics import round_e4m3, spread, token_scales

INF, NAN = math.inf, math.nan


def edge_rows(h: int, g: int) -> torch.Tensor:
    """Rows [6, h] (h a multiple of g) whose groups hold the edge cases: all zeros, a
    NaN, an inf, values past 448, a tiny group (below the floor), and random ones."""
    gen = torch.Generator().manual_seed(h + g)
    magnitude = torch.exp2(torch.randint(-8, 12, (6, h // g), generator=gen).float())
    x = torch.randn(6, h, generator=gen) * magnitude.repeat_interleave(g, dim=-1)
    x[0, :g] = 0.0
    x[1, 1] = NAN
    x[2, g - 1] = -INF
    x[3, :g] = torch.linspace(-3072.0, 2000.0, g)  # past 448: the group's max maps to 448
    x[4, :g] = 1e-7  # amax below the 1e-4 floor
    return x.bfloat16().float()


@pytest.mark.parametrize(("h", "g"), [(128, 128), (256, 128), (64, 16), (8, 8)])
def test_a_group_is_cast_as_a_token_of_its_channels(h: int, g: int) -> None:
    x = edge_rows(h, g)
    scale, inverse = token_scales(x, group=g)
    assert scale.shape == inverse.shape == (6, h // g)
    for k in range(h // g):  # the per-token rule on the group's slice: the same bits
        alone, alone_inv = token_scales(x[:, k * g:(k + 1) * g])
        torch.testing.assert_close(scale[:, k], alone, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(inverse[:, k], alone_inv, rtol=0, atol=0, equal_nan=True)
    q = round_e4m3(x * spread(inverse, g))
    floor = float(np.float32(1e-4) / np.float32(448.0))
    assert float(scale[0, 0]) == floor  # zeros: the floor
    assert bool((q[0, :g] == 0).all())
    assert math.isnan(scale[1, 0]) and bool(q[1, :g].isnan().all())  # NaN: its group only
    assert math.isinf(scale[2, 0]) and math.isnan(q[2, g - 1])  # inf: scale inf, inf NaN
    assert bool((q[2, :g - 1] == 0).all())  # the rest 0 (x * 448 / inf)
    assert float(q[3, 0]) == -448.0 and float(q[3, :g].abs().max()) == 448.0
    assert float(scale[3, 0]) == float(np.float32(3072.0) / np.float32(448.0))
    assert float(scale[4, 0]) == floor  # below the floor
    if h > g:  # the other groups keep their own scales, whatever the first holds
        assert bool(scale[:5, 1:].isfinite().all())
    if h == g:  # one group: the per-token scales, one dim more
        whole, _ = token_scales(x)
        torch.testing.assert_close(scale[:, 0], whole, rtol=0, atol=0, equal_nan=True)


BACK = {"src": "fp8e4m3", "dst": "f16", "s_sym": False, "reads": "[y, m]"}  # s: the sender's


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"h": 128, "s_shape": "[W, C, 1]"}, []),  # H = G: one scale per row, kept as a dim
    (BACK, []),
    ({"group": 16, "s_shape": "[W, C, 16]"}, []),
    ({"s_shape": "[W, C]"}, [("shape-mismatch", 11, 51)]),  # the per-token shape: refused
    ({"s_shape": "[W, C, 4]"}, [("shape-mismatch", 11, 51)]),
    ({**BACK, "s_shape": "[W, C, H]"}, [("shape-mismatch", 11, 51)]),
    ({"h": 192, "s_shape": "[W, C, 2]"}, [("inexact-division", 11, 38)]),  # 192 / 128
    ({"group": 96, "s_shape": "[W, C, 2]"}, [("bad-scale", 11, 38)]),  # no power of two
    ({"group": 2048, "s_shape": "[W, C, 1]"}, [("bad-scale", 11, 38)]),  # past 1024
    ({"per": "tensor", "s_shape": "[1]", "s_sym": False, "reads": "[y, m]"},
     [("bad-scale", 11, 39)]),
    ({"group": "true"}, [("wrong-type", 11, 38)]),  # a strict integer, as 'groups'
    ({"group": '"128"'}, [("wrong-type", 11, 38)]),
    ({"group": "128.0"}, [("wrong-type", 11, 38)]),
])
def test_verifier(change: dict[str, Any], want: list[tuple[str, int, int]],
                  tmp_path: Path) -> None:
    """Located at the step's ``scale``: its ``buffer`` (col 51) or its ``group`` (col 38;
    39 after ``per: tensor``)."""
    assert error_marks(ragged_cast(**change), tmp_path, "cast.yaml") == want


A2A = """\
schedule: cast_a2a
sizes: {C: {max: 4}}
buffers:
  x: {shape: [W*C, 128], dtype: f32}
  q: {shape: [W, C, 128], dtype: fp8e4m3, symmetric: true}
  s: {shape: [W, C, 1], dtype: f32, symmetric: true}
steps:
  - there: {op: all_to_all, src: x, dst: q, scale: {per: token, group: 128, buffer: s}}
  - use:   {op: external, reads: [q, s]}
  - done:  {op: barrier}
"""


def test_a_group_on_an_all_to_all_is_proved_and_its_scales_checked(tmp_path: Path) -> None:
    """Refused at 9f82130 after wrong bytes on an H100; their cause (byte-pair shared
    stores of an [8, 128] f32 tile on 4 warps, benchmarks/diag/grouped_cast_a2a) is
    launched around (ScheduleModule._fp8_tile): proved, its ``s`` checked as the ragged
    one's."""
    assert error_marks(A2A, tmp_path, "a2a.yaml") == []
    per_row = A2A.replace("[W, C, 1]", "[W, C]")  # one scale per row, not per group
    assert error_marks(per_row, tmp_path, "a2a_row.yaml") == [("shape-mismatch", 8, 85)]


def test_a_located_message_names_the_group_and_the_rows(tmp_path: Path) -> None:
    from support.schedules import diagnostics

    (d,) = diagnostics(ragged_cast(h=192, s_shape="[W, C, 2]"), tmp_path, "cast.yaml")
    assert "by 128 channels" in d.message and "'y'" in d.message and "H=192" in d.message
    assert d.hint == "make the last dim of 'y' a multiple of 128"
    assert "H=192" in d.message and "for W=" in d.message, d.message  # H named: its binding
    literal = ragged_cast(s_shape="[W, C, 2]").replace("[W, C, H]", "[W, C, 192]")
    (d,) = diagnostics(literal, tmp_path, "cast.yaml")  # a literal length: nothing to bind
    assert d.message.endswith("their length 192 is not a multiple of 128"), d.message
    (d,) = diagnostics(ragged_cast(s_shape="[W, C]"), tmp_path, "cast.yaml")
    assert "per 128 channels" in d.message, d.message


def _child() -> None:
    """Quantise (cast 1) and dequantise (cast 3) per group at H = G and H = 2G, W = 2:
    the kernel's dst and scales vs the torch backend's function and the float64
    reference, bit for bit (a NaN as a NaN)."""
    import tempfile

    from dcpc.harness.run import compile_to
    from dcpc.harness.simulate import simulate_call
    from dcpc.harness.worker import load_module_class
    from dcpc.lang.parse import parse_text
    from dcpc.runtime import collectives

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.allclose(a.double(), b.double(), rtol=0, atol=0, equal_nan=True))

    world, cap, g = 2, 6, 128
    out: dict[str, Any] = {}
    for h in (g, 2 * g):
        for mode in (1, 3):
            back = mode == 3
            source = ragged_cast(h=h, s_shape=f"[W, C, {h // g}]", **(BACK if back else {}))
            gen = torch.Generator().manual_seed(h + mode)
            if back:  # e4m3 values and positive scales, one NaN (a NaN group's scale),
                # and NaN bytes 0x7F, 0xFF in q (the interpreter read them as +-480 before
                # _dcpc_widen mapped them)
                xs = [round_e4m3(torch.randn(world, cap, h, generator=gen) * 100)
                      for _ in range(world)]
                xs[1][0, 1, :2] = torch.tensor([NAN, -NAN])
                xs = [x.to(torch.float8_e4m3fn) for x in xs]
                scales = [torch.rand(world, cap, h // g, generator=gen) + 0.01
                          for _ in range(world)]
                scales[0][1, 0, h // g - 1] = NAN
            else:
                xs = [edge_rows(h, g).reshape(1, cap, h).repeat(world, 1, 1).bfloat16()
                      for _ in range(world)]
                scales = [torch.zeros(world, cap, h // g) for _ in range(world)]
            counts = [torch.full((world,), cap, dtype=torch.int32) for _ in range(world)]
            counts[1][0] = 4  # a ragged block: rows past it never sent
            with tempfile.TemporaryDirectory(prefix="dcpc-group-") as tmp:
                path = Path(tmp) / "cast.yaml"
                path.write_text(source)
                _, module, _, _ = compile_to(str(path), Path(tmp), world)

                def rank_main(rank: Any, module: str = module, xs: list = xs,
                              counts: list = counts, scales: list = scales,
                              back: bool = back) -> Any:
                    r = rank.rank
                    inst = load_module_class(module, "cast")(rank, sizes={"C": cap},
                                                             device="cpu", backend="local")
                    args = [xs[r], counts[r]] + ([scales[r]] if back else [])
                    y, _ = inst.move(*args)
                    s = None if back else inst.buffer("s", 0, {"C": cap}).clone()
                    y = y.clone()
                    rank.barrier()
                    inst.close()
                    return y, s

                got = run_ranks(world, rank_main)
            inputs = [{"x": xs[p].double() if not back else xs[p].float().double(),
                       "n": counts[p].long(), **({"s": scales[p].double()} if back else {})}
                      for p in range(world)]
            ref = simulate_call(parse_text(source), world, {"C": cap, "H": h}, inputs,
                                lambda step, r, bufs: {})
            exact, torch_exact = True, True
            for j in range(world):
                y, s = got[j]
                for p in range(world):
                    n = int(counts[p][j])
                    exact &= same(y[p, :n], ref[j]["y"][p, :n])
                    if s is not None:
                        exact &= same(s[p, :n], ref[j]["s"][p, :n])
                    # the torch backend's cast of sender p's block (W = 1: a copy)
                    dst = torch.zeros(1, cap, h, dtype=y.dtype)
                    sc = scales[p][j:j + 1].clone()
                    collectives.ragged_all_to_all(
                        collectives.SlotGroup(None, 0, 0, None), xs[p][j:j + 1],
                        counts[p][j:j + 1], dst, torch.zeros(1, dtype=torch.int32), cap, 1,
                        "move", mode, sc, group=g)
                    torch_exact &= same(dst[0, :n], ref[j]["y"][p, :n])
                    if s is not None:
                        torch_exact &= same(sc[0, :n], ref[j]["s"][p, :n])
            nan_kept = any(bool(got[j][0].float().isnan().any()) for j in range(world))
            out[f"{h}/{mode}"] = {"exact": exact, "torch": torch_exact, "nan": nan_kept}
    print("RESULT " + json.dumps(out))


@pytest.mark.e2e
def test_grouped_casts_are_exact_on_kernels_torch_and_reference() -> None:
    result = child_result(__file__, "group")  # about 10 s of interpreter
    want = {"exact": True, "torch": True, "nan": True}
    assert result == {f"{h}/{m}": want for h in (128, 256) for m in (1, 3)}, result


OP_FILE = Path(__file__).resolve().parents[2] / "schedules/ops/ragged_all_to_all_fp8_group.yaml"


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [(3, "torch"), (2, "local")], ids=str)
def test_the_op_file_matches_float64_on_torch_and_local(world: int, backend: str) -> None:
    """Every output and both scale buffers, every call, bit for bit (about 10 s each)."""
    from support.schedules import run_clean

    report, text = run_clean(schedule=str(OP_FILE), world=world, backend=backend, calls=4,
                             seed=1, programs=2)
    for name in ("q_recv", "s_recv", "y_back", "q", "s", "y"):
        stats = report.outputs[name]  # type: ignore[attr-defined]
        assert stats.compared == 4 * world and stats.max_abs_err == 0.0, (name, text)


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["host", "torch", "local"])
def test_grouped_e5m2_round_trip_matches_float64(backend: str, tmp_path: Path) -> None:
    """The op file with fp8e5m2 for fp8e4m3: a group's scale is its amax / 57344
    (numerics.token_scales by FP8_FORMATS' top; the kernel's attrs.fp8_top), quantised
    and dequantised per group, W = 2, every output and scale bit for bit."""
    from support.schedules import run_clean

    path = tmp_path / "group_e5m2.yaml"
    path.write_text(OP_FILE.read_text().replace("fp8e4m3", "fp8e5m2"))
    assert "fp8e5m2" in path.read_text()
    report, text = run_clean(schedule=str(path), world=2, backend=backend, calls=3, seed=2,
                             programs=2)
    for name in ("q_recv", "s_recv", "y_back", "q", "s", "y"):
        stats = report.outputs[name]  # type: ignore[attr-defined]
        assert stats.compared == 3 * 2 and stats.max_abs_err == 0.0, (name, text)


MIDDLE = """\
schedule: token_mid
sizes: {{C: {{max: 3}}, H: {h}}}
buffers:
  x_send: {{shape: [W, C, 2, H], dtype: bf16}}
  counts: {{shape: [W], dtype: i32}}
  q_recv: {{shape: [W, C, 2, H], dtype: fp8e4m3, symmetric: true}}
  s_recv: {{shape: [W, C, 2], dtype: f32, symmetric: true}}
  n_recv: {{shape: [W], dtype: i32, symmetric: true}}
  y_back: {{shape: [W, C, 2, H], dtype: f16, symmetric: true}}
  n_back: {{shape: [W], dtype: i32, symmetric: true}}
steps:
  - there: {{op: ragged_all_to_all, src: x_send, dst: q_recv, counts: counts,
            recv_counts: n_recv, capacity: C, scale: {{per: token, buffer: s_recv}}}}
  - back:  {{op: ragged_all_to_all, src: q_recv, dst: y_back, counts: n_recv,
            recv_counts: n_back, capacity: C, scale: {{per: token, buffer: s_recv}}}}
  - use:   {{op: external, reads: [q_recv, s_recv, y_back, n_back]}}
  - done:  {{op: barrier}}
"""


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [(2, "local"), (3, "torch")], ids=str)
def test_per_token_rows_with_middle_dims_match_float64(world: int, backend: str,
                                                       tmp_path: Path) -> None:
    """Rows [2, H] after the capacity, per token without ``group``: one scale per row of
    the last dim (the reference's rule), which the kernel takes as its tile of H channels
    (its own row is every dim after the capacity: it made one scale of 2H channels
    before), while the torch backend's call keeps the scales' shape [W, C, 2]."""
    from support.schedules import run_clean

    path = tmp_path / "token_mid.yaml"
    path.write_text(MIDDLE.format(h=32))
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=3,
                             seed=0, programs=2)
    for name in ("q_recv", "s_recv", "y_back"):
        stats = report.outputs[name]  # type: ignore[attr-defined]
        assert stats.compared == 3 * world, (name, text)


@pytest.mark.parametrize("h", ["24", "{multiple_of: W}"])
def test_middle_dims_with_a_last_dim_the_kernel_cannot_tile_are_refused(h: str,
                                                                       tmp_path: Path) -> None:
    """No power of two (24), or no integer (bound at construction): ``bad-scale`` at each
    cast's ``per: token``, naming the buffer's shape and what to write."""
    from support.schedules import diagnostics

    found = diagnostics(MIDDLE.format(h=h), tmp_path, "mid.yaml")
    assert [(d.code, d.mark.line, d.mark.col) for d in found] == [
        ("bad-scale", 13, 60), ("bad-scale", 15, 60)], found  # at "token"
    assert "'q_recv' [W, C, 2, H] per token" in found[0].message, found[0].message
    assert "power of two up to 1024" in found[0].message
    assert found[0].hint is not None and "one dim after the capacity" in found[0].hint


if __name__ == "__main__" and sys.argv[1:] == ["group"]:
    _child()
