"""A cast inside a move (dcpc/ops/cast.py, on ragged_all_to_all): the fp8 rounding rule,
the verifier (every mismatch without a supported cast and scale is still refused), the
checker against the brute force on the scale buffer, and the kernels (ranks as threads:
the ``local`` backend on CPU) equal bit for bit to the torch backend and the float64
reference in all four modes, into e4m3 and e5m2, with random inputs and amax per token.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import script_env
from support.hb_oracle import oracle_keys
from support.kernels import run_ranks
from support.schedules import codes

from dcpc.check import hb
from dcpc.lang.parse import parse_text
from dcpc.numerics import FP8_FORMATS, ieee_div, round_e4m3, round_fp8, token_scales

# per format: ties (half a step between two grid values, a subnormal one too), a value
# past the largest, an inf, and what the rule gives them (away from zero; saturated)
TIES = {
    "fp8e4m3": ([168.0, -168.0, 9.5 * 2.0**-9, 2.0**-10, 1e6, -float("inf")],
                [176.0, -176.0, 10 * 2.0**-9, 2.0**-9, 448.0, -448.0]),
    "fp8e5m2": ([36864.0, -36864.0, 2.5 * 2.0**-16, 2.0**-17, 61440.0, float("inf")],
                [40960.0, -40960.0, 3 * 2.0**-16, 2.0**-16, 57344.0, 57344.0]),
}


@pytest.mark.parametrize("fp8", ["fp8e4m3", "fp8e5m2"])
def test_round_fp8_is_nearest_with_ties_away_and_saturates(fp8: str) -> None:
    top = FP8_FORMATS[fp8][0]
    torch_dtype = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}[fp8]
    g = torch.Generator().manual_seed(0)
    y = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-20, 17, (20000,),
                                                                   generator=g).float())
    r = round_fp8(y, fp8)
    clamped = y.clamp(-top, top)
    assert torch.equal(r.to(torch_dtype).float(), r)  # on the grid
    nearest = clamped.to(torch_dtype).float()  # torch: to nearest, ties to even
    tie = (r - clamped).abs() == (nearest - clamped).abs()
    assert bool(tie.all()), "round_fp8 is not a nearest rounding"
    assert bool((r == 0).any()) and bool((r.abs() == top).any())  # both ends were drawn
    ties, want = TIES[fp8]
    got = round_fp8(torch.tensor([*ties, float("nan"), -0.0]), fp8)
    assert got[:6].tolist() == want
    assert bool(got[6].isnan()) and got[7].item() == 0 and bool(torch.signbit(got[7]))
    assert torch.equal(round_e4m3(y), round_fp8(y, "fp8e4m3"))


# just below half the smallest subnormal (e4m3 2**-9, e5m2 2**-16): x / ulp = 0.5 - 2**-25,
# which floor(x + 0.5) rounds up (1 - 2**-25 is 1.0 in fp32); nearest is 0 (-0 negative)
BELOW_HALF = {"fp8e4m3": 2.0**-10 - 2.0**-34, "fp8e5m2": 2.0**-17 - 2.0**-41}


@pytest.mark.parametrize("fp8", ["fp8e4m3", "fp8e5m2"])
def test_round_fp8_rounds_just_below_a_half_down(fp8: str) -> None:
    v = BELOW_HALF[fp8]
    got = round_fp8(torch.tensor([v, -v, 3 * v]), fp8)
    assert got[0].item() == 0.0 and got[1].item() == 0.0 and bool(torch.signbit(got[1]))
    step = 2.0**-9 if fp8 == "fp8e4m3" else 2.0**-16
    assert got[2].item() == step  # 1.5 - 3 * 2**-25 steps: one step
    assert got.tolist() == torch.tensor([v, -v, 3 * v]).double().to(
        {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}[fp8]).float().tolist()


def test_scales_divide_as_the_kernels_do() -> None:
    """448 / 1.9140625: torch's scalar / tensor is one ulp off; numpy (the interpreter)
    and a GPU divide correctly rounded, and so does ieee_div."""
    amax = np.float32(1.9140625)
    assert ieee_div(448.0, torch.tensor(1.9140625)).item() == float(np.float32(448.0) / amax)
    rows = torch.tensor([[1.9140625, -0.5], [0.0, 0.0]])
    scale, inverse = token_scales(rows)
    assert inverse[0].item() == float(np.float32(448.0) / amax)
    assert scale[1].item() == float(np.float32(1e-4) / np.float32(448.0))  # the floor


def test_scales_divide_on_the_operands_device() -> None:
    """ieee_div divides on a's device (else b's), never by a CPU scalar tensor: CUDA's
    true divide by one computes a * (1 / b) (one bit off the kernels' div_rn). The
    meta device stands in for a GPU: every operand of the division is seen on it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.devices: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.overloadpacket is torch.ops.aten.div:
                self.devices += [str(t.device) for t in args if isinstance(t, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    on = torch.ones(3, device="meta")
    with Seen() as seen:
        results = [ieee_div(on, 448.0), ieee_div(448.0, on), ieee_div(1.0, on[:1]),
                   ieee_div(on, torch.tensor([2.0]))]
    assert seen.devices == ["meta"] * 8
    assert {str(r.device) for r in results} == {"meta"}
    assert ieee_div(448.0, 1.9140625).device.type == "cpu"  # no tensor: the default device


SCHEDULE = """\
schedule: cast
sizes: {{C: {{max: 4}}, H: 8}}
buffers:
  x:  {{shape: [W, C, H], dtype: {src}}}
  n:  {{shape: [W], dtype: i32}}
  y:  {{shape: [W, C, H], dtype: {dst}, symmetric: true}}
  s:  {{shape: {s_shape}, dtype: {s_dtype}{s_sym}}}
  m:  {{shape: [W], dtype: i32, symmetric: true}}
  e:  {{shape: [W, C, H], dtype: bf16}}
steps:
  - move: {{op: ragged_all_to_all, src: x, dst: y, counts: n, recv_counts: m, capacity: C{scale}}}
  - use:  {{op: external, reads: {reads}, writes: [e]}}
{tail}"""


def text(**kw: str) -> str:
    spec = {"src": "bf16", "dst": "fp8e4m3", "s_shape": "[W, C]", "s_dtype": "f32",
            "s_sym": ", symmetric: true", "scale": ", scale: {per: token, buffer: s}",
            "tail": "  - done: {op: barrier}\n", "reads": "[y, s, m]", **kw}
    return SCHEDULE.format(**spec)


TENSOR = ", scale: {per: tensor, buffer: s}"
READ = {"s_sym": "", "reads": "[y, m]"}  # s is the sender's: the engine passes it


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"scale": TENSOR, "s_shape": "[1]", **READ}, []),
    ({"src": "fp8e4m3", "dst": "bf16", **READ}, []),
    ({"src": "fp8e4m3", "dst": "f32", "scale": TENSOR, "s_shape": "[1]", **READ}, []),
    ({"scale": "", **READ}, ["dtype-mismatch"]),  # a cast without its scale: refused
    ({"src": "fp8e4m3", "dst": "bf16", "scale": "", **READ}, ["dtype-mismatch"]),
    ({"dst": "bf16", **READ}, ["bad-cast"]),  # a scale on a move without a cast
    ({"dst": "f32", **READ}, ["bad-cast"]),  # bf16 -> f32 is no supported cast
    ({"s_shape": "[W, C, H]"}, ["shape-mismatch"]),
    ({"scale": TENSOR, **READ}, ["shape-mismatch"]),  # a tensor scale is [1]
    ({"s_dtype": "bf16"}, ["bad-scale"]),
    ({"s_sym": "", "reads": "[y, m]"}, ["bad-scale"]),  # the scales travel: symmetric
    ({"src": "f16", "dst": "fp8e5m2"}, []),  # e5m2 both ways, as e4m3
    ({"src": "fp8e5m2", "dst": "f32", "scale": TENSOR, "s_shape": "[1]", **READ}, []),
    ({"src": "fp8e4m3", "dst": "fp8e5m2", **READ}, ["bad-cast"]),  # fp8 to fp8: none
    ({"src": "fp8e5m2", "dst": "fp8e4m3", **READ}, ["bad-cast"]),
    ({"src": "i32", "dst": "fp8e5m2", **READ}, ["bad-cast"]),  # an integer never casts
])
def test_verifier(change: dict[str, str], want: list[str], tmp_path: Path) -> None:
    assert codes(text(**change), tmp_path, "cast.yaml") == want


def test_bad_cast_hints_by_the_pair(tmp_path: Path) -> None:
    """fp8 to fp8 names the two moves through a wide float; a wide float to a wide float
    names the fp8 dst; one dtype, dropping the scale."""
    from support.schedules import diagnostics

    def hint(**change: str) -> str:
        (d,) = diagnostics(text(**change, **READ), tmp_path, "cast.yaml")
        assert d.code == "bad-cast", d
        return str(d.hint)

    assert hint(src="fp8e4m3", dst="fp8e5m2") == (
        "dequantise 'x' to bf16, f16 or f32 first (a move into a buffer of one), then "
        "quantise that into 'y'")
    assert "dequantise 'x'" in hint(src="fp8e5m2", dst="fp8e4m3")
    assert hint(dst="f32") == "declare 'y' with dtype fp8e4m3 (or 'x')"
    assert hint(dst="bf16") == "drop 'scale' for a move without a cast"


def test_the_fp8_formats_are_read_from_one_table() -> None:
    """cast.FP8, DType.is_fp8 and merge.fp8_format follow dcpc.numerics.FP8_FORMATS; a
    dtype that is no fp8 format is an error, never taken as e4m3."""
    from dcpc.lang.nodes import DType
    from dcpc.numerics import FP8_FORMATS
    from dcpc.ops import cast
    from dcpc.runtime import merge
    from dcpc.runtime.validate import DTYPES

    assert cast.FP8 == tuple(FP8_FORMATS)
    assert [d.value for d in DType if d.is_fp8] == list(FP8_FORMATS)
    assert [merge.fp8_format(DTYPES[f]) for f in FP8_FORMATS] == list(FP8_FORMATS)
    with pytest.raises(ValueError, match="no fp8 format"):
        merge.fp8_format(torch.bfloat16)


def test_checker_and_brute_force_see_the_scale_buffer() -> None:
    """Without the barrier the next call's move stores into y, m and the receiving s
    while `use` may still read them: the same races from both, the scale's included."""
    schedule = parse_text(text(tail=""))
    want = {("race", "write-after-read", b, "use", "move") for b in ("y", "s", "m")}
    want.add(("race", "write-after-read", "m", "move", "move"))  # its count check reads m
    want.add(("race", "write-after-read", "y", "move", "move"))  # the engine reads what it returns
    for world in (2, 3):
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world) == want
    # a dequantise reads s on the sender: a read, not a remote store
    back = parse_text(text(src="fp8e4m3", dst="bf16", tail="", **READ))
    assert {f.key for f in hb.check(back, [2], hints=False).findings} == oracle_keys(back, 2)


MODES = {  # the kernel's CAST, by e4m3 and e5m2: (CAST, src, dst, per)
    "1": (1, "bf16", "fp8e4m3", "token"), "2": (2, "bf16", "fp8e4m3", "tensor"),
    "3": (3, "fp8e4m3", "bf16", "token"), "4": (4, "fp8e4m3", "f32", "tensor"),
    "1e5": (1, "f16", "fp8e5m2", "token"), "2e5": (2, "bf16", "fp8e5m2", "tensor"),
    "3e5": (3, "fp8e5m2", "f16", "token"), "4e5": (4, "fp8e5m2", "f32", "tensor"),
}


def _mode_text(mode: str) -> str:
    cast, src, dst, per = MODES[mode]
    shape = "[W, C]" if per == "token" else "[1]"
    sym = ", symmetric: true" if cast == 1 else ""
    return text(src=src, dst=dst, s_shape=shape, s_sym=sym, tail="",
                reads="[y, s, m]" if cast == 1 else "[y, m]",
                scale=f", scale: {{per: {per}, buffer: s}}")


def _child() -> None:
    """Every mode at W = 2: the kernel's dst (and scales) vs the torch backend's function
    and the float64 reference, bit for bit."""
    import tempfile

    from dcpc.harness.run import compile_to
    from dcpc.harness.simulate import simulate_call
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime import collectives

    world, cap, h = 2, 4, 8
    out: dict[str, Any] = {}
    for mode, (cast, src_t, dst_t, per) in MODES.items():
        g = torch.Generator().manual_seed(cast + (100 if "e5" in mode else 0))
        dtype = {"bf16": torch.bfloat16, "fp8e4m3": torch.float8_e4m3fn, "f32": torch.float32,
                 "f16": torch.float16, "fp8e5m2": torch.float8_e5m2}
        xs = [(torch.randn(world, cap, h, generator=g) * (1 + 30 * torch.rand(world, cap, 1,
               generator=g))).to(dtype[src_t]) for _ in range(world)]
        counts = [torch.randint(0, cap + 1, (world,), generator=g, dtype=torch.int32)
                  for _ in range(world)]
        scales = [(torch.rand(world, cap, generator=g) + 0.01) if per == "token"
                  else torch.rand(1, generator=g) + 0.01 for _ in range(world)]
        with tempfile.TemporaryDirectory(prefix="dcpc-cast-") as tmp:
            path = Path(tmp) / "cast.yaml"
            path.write_text(_mode_text(mode))
            _, module, _, _ = compile_to(str(path), Path(tmp), world)

            def rank_main(rank: Any, module: str = module, mode: int = cast,
                          xs: list = xs, counts: list = counts, scales: list = scales) -> Any:
                r = rank.rank
                inst = load_module_class(module, "cast")(rank, sizes={"C": cap},
                                                         device="cpu", backend="local")
                args = [xs[r], counts[r]] + ([scales[r]] if mode != 1 else [])
                y, _ = inst.move(*args)
                s = inst.buffer("s", 0, {"C": cap}).clone() if mode == 1 else None
                y = y.clone()
                rank.barrier()
                inst.close()
                return y, s

            got = run_ranks(world, rank_main)
        schedule = parse_text(_mode_text(mode))
        inputs = [{"x": xs[p].double(), "n": counts[p].long(),
                   **({"s": scales[p].double()} if cast != 1 else {})} for p in range(world)]
        ref = simulate_call(schedule, world, {"C": cap, "H": h}, inputs,
                            lambda step, r, bufs: {"e": torch.zeros(world, cap, h)})
        exact, torch_exact = True, True
        for j in range(world):
            y, s = got[j]
            for p in range(world):
                n = int(counts[p][j])
                exact &= torch.equal(y[p, :n].double(), ref[j]["y"][p, :n])
                if cast == 1:
                    exact &= torch.equal(s[p, :n].double(), ref[j]["s"][p, :n])
            # the torch backend's cast, one sender at a time (W = 1: the collective copies)
            for p in range(world):
                block = xs[p][j : j + 1]
                dst = torch.zeros(1, cap, h, dtype=dtype[dst_t])
                sc = torch.zeros(1, cap) if cast == 1 else (
                    scales[p][j : j + 1] if per == "token" else scales[p])
                collectives.ragged_all_to_all(
                    collectives.SlotGroup(None, 0, 0, None), block, counts[p][j : j + 1],
                    dst, torch.zeros(1, dtype=torch.int32), cap, 1, "move", cast, sc)
                n = int(counts[p][j])
                torch_exact &= torch.equal(dst[0, :n].double(), ref[j]["y"][p, :n])
        out[mode] = {"exact": bool(exact), "torch": bool(torch_exact)}
    print("RESULT " + json.dumps(out))


@pytest.mark.e2e
def test_every_cast_mode_is_exact_on_kernels_torch_and_reference() -> None:
    env = script_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "modes"], capture_output=True,
                          text=True, timeout=400, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {m: {"exact": True, "torch": True} for m in MODES}, result


A2A = """\
schedule: a2a
sizes: {{T: {{max: 3}}, H: 8}}
buffers:
  x:  {{shape: [W*T, H], dtype: bf16}}
  q:  {{shape: [W, T, H], dtype: fp8e4m3, symmetric: true}}
  s:  {{shape: [W, T], dtype: f32, symmetric: true}}
  t:  {{shape: [1], dtype: f32}}
  y:  {{shape: [W, 1, T, H], dtype: {back}, symmetric: true}}
steps:
  - go:   {{op: all_to_all, src: {src}, dst: q{go}}}
  - back: {{op: all_to_all, src: q, dst: y{back_scale}}}
  - done: {{op: barrier}}
"""


def a2a_text(**kw: str) -> str:
    spec = {"back": "bf16", "src": "x", "go": ", scale: {per: token, buffer: s}",
            "back_scale": ", scale: {per: token, buffer: s}", **kw}
    return A2A.format(**spec)


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"back": "f32", "back_scale": ", scale: {per: tensor, buffer: t}"}, []),
    ({"back_scale": ""}, ["dtype-mismatch"]),  # the way back needs its scale too
    ({"go": ", dim: 1, scale: {per: token, buffer: s}"}, ["bad-cast"]),
    # one payload per cast (and s, which such a cast would send, is then never written)
    ({"src": "[x]"}, ["bad-cast", "read-before-write"]),
])
def test_all_to_all_cast_verifier(change: dict[str, str], want: list[str],
                                  tmp_path: Path) -> None:
    assert codes(a2a_text(**change), tmp_path, "cast.yaml") == want


def _a2a_child() -> None:
    """all_to_all there (bf16 -> fp8 per token) and back (fp8 -> bf16 per token, and
    fp8 -> f32 per tensor): the kernels vs the float64 reference, bit for bit."""
    import tempfile

    from dcpc.harness.run import compile_to
    from dcpc.harness.simulate import simulate_call
    from dcpc.harness.worker import load_module_class

    world, rows, h = 3, 3, 8
    out = {}
    for back, scale in (("bf16", "{per: token, buffer: s}"), ("f32", "{per: tensor, buffer: t}")):
        source = a2a_text(back=back, back_scale=f", scale: {scale}")
        g = torch.Generator().manual_seed(len(back))
        xs = [(torch.randn(world * rows, h, generator=g) * 20).bfloat16() for _ in range(world)]
        ts = [torch.rand(1, generator=g) + 0.01 for _ in range(world)]
        with tempfile.TemporaryDirectory(prefix="dcpc-a2a-") as tmp:
            path = Path(tmp) / "a2a.yaml"
            path.write_text(source)
            _, module, _, _ = compile_to(str(path), Path(tmp), world)

            def rank_main(rank: Any, module: str = module, xs: list = xs, ts: list = ts,
                          tensor: bool = back == "f32") -> Any:
                inst = load_module_class(module, "a2a")(rank, sizes={"T": rows}, device="cpu",
                                                        backend="local")
                q = inst.go(xs[rank.rank]).clone()
                y = (inst.back(ts[rank.rank]) if tensor else inst.back()).clone()
                inst.done()
                inst.close()
                return q, y

            got = run_ranks(world, rank_main)
        inputs = [{"x": xs[p].double(), "t": ts[p].double()} for p in range(world)]
        ref = simulate_call(parse_text(source), world, {"T": rows, "H": h}, inputs,
                            external=None)  # type: ignore[arg-type]
        out[back] = all(torch.equal(got[r][0].double(), ref[r]["q"])
                        and torch.equal(got[r][1].double(), ref[r]["y"]) for r in range(world))
    print("RESULT " + json.dumps(out))


@pytest.mark.e2e
def test_all_to_all_casts_are_exact_on_the_kernels() -> None:
    env = script_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "a2a"], capture_output=True,
                          text=True, timeout=400, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads(lines[-1][len("RESULT "):]) == {"bf16": True, "f32": True}


if __name__ == "__main__" and sys.argv[1:] == ["modes"]:
    _child()
if __name__ == "__main__" and sys.argv[1:] == ["a2a"]:
    _a2a_child()


def test_generated_modules_of_every_mode_are_ruff_clean(tmp_path: Path) -> None:
    """Each step's kernel holds only its own mode's code (no name of a helper the module
    does not emit): the modules of the gallery, every ragged cast mode and the all_to_all
    casts check and format clean, as the shipped schedules' (tests/codegen/test_codegen.py)."""
    from support.ruff import RUFF, RUFF_CONFIG

    from dcpc.codegen.emit import emit
    from dcpc.codegen.lower import lower

    root = Path(__file__).resolve().parents[2]
    texts = [(root / "schedules/gallery/moe_dispatch_combine.yaml").read_text(),
             (root / "schedules/ops/ragged_all_to_all_fp8_deepep.yaml").read_text(),
             text(tail=""), text(dst="bf16", scale="", **READ),  # a module without casts
             a2a_text(), *[_mode_text(mode) for mode in MODES]]
    files = []
    for i, source in enumerate(texts):
        files.append(tmp_path / f"m{i}.py")
        files[-1].write_text(emit(lower(parse_text(source), range(2, 9))))
    for args in (["check"], ["format", "--check", "--diff"]):
        done = subprocess.run(RUFF + [*args, "--no-cache", *RUFF_CONFIG, *map(str, files)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_read_scale_is_an_engine_input_of_dcpc_run() -> None:
    """`dcpc run` makes the inputs the ops read (OpDef.io): a per-tensor scale of a cast
    in an all_to_all or a ragged all_to_all is one; a per-token scale that the move
    sends (symmetric) is not."""
    from dcpc.harness.synth import engine_inputs

    tensor = ", scale: {per: tensor, buffer: t}"
    a2a = parse_text(a2a_text(back="f32", back_scale=tensor, go=tensor))
    assert engine_inputs(a2a) == ["x", "t"]
    assert engine_inputs(parse_text(text())) == ["x", "n"]
    assert engine_inputs(parse_text(_mode_text("4"))) == ["x", "n", "s"]
    assert engine_inputs(parse_text(_mode_text("4e5"))) == ["x", "n", "s"]
