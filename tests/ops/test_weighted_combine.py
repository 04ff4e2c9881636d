"""weighted_combine (dcpc/ops/weighted_combine.py): the verifier's refusals, the float64
reference, the torch backend's fp32 sum, and the kernel (ranks as threads: the ``local``
backend on CPU) against float64, its empty slots over NaN rows and its bad-index error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import script_env
from support.schedules import codes

from dcpc.harness.simulate import simulate_call
from dcpc.lang.parse import parse_text

BASE = """\
schedule: wc
sizes: {{T: {{max: 5}}, K: 3, R: 7, H: 16}}
buffers:
  x:   {{shape: {x_shape}, dtype: {x}}}
  w:   {{shape: {w_shape}, dtype: f32}}
  idx: {{shape: [T, K], dtype: {idx}}}
  out: {{shape: {out_shape}, dtype: {out}}}
steps:
  - combine: {{op: weighted_combine, src: [x, w], dst: out{index}}}
"""


SIZES = {"T": 5, "K": 3, "R": 7, "H": 16}


def text(**kw: str) -> str:
    spec = {"x_shape": "[R, H]", "x": "bf16", "w_shape": "[T, K]", "idx": "i32",
            "out_shape": "[T, H]", "out": "bf16", "index": ", index: idx", **kw}
    return BASE.format(**spec)


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"index": "", "x_shape": "[T, K, H]"}, []),
    ({"index": ""}, ["shape-mismatch"]),  # without index x must be [T, K, H]
    ({"idx": "f32"}, ["bad-index"]),
    ({"w_shape": "[T, K, 1]"}, ["shape-mismatch"]),
    ({"out_shape": "[T, H + 1]"}, ["shape-mismatch"]),
    ({"x": "i32"}, ["non-float-output"]),
    ({"x_shape": "[R]"}, ["shape-mismatch"]),
])
def test_verifier(change: dict[str, str], want: list[str], tmp_path: Path) -> None:
    assert codes(text(**change), tmp_path, "wc.yaml") == want


def _case(seed: int) -> dict[str, torch.Tensor]:
    """x [7, 16] with row 6 NaN (never sent), weights [5, 3], index with empty slots,
    some pointing at... nothing past row 5."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 16, generator=g, dtype=torch.float64).to(torch.bfloat16).double()
    x[6] = float("nan")
    idx = torch.randint(0, 6, (5, 3), generator=g)
    idx[0, 1] = idx[3, 0] = idx[4, 2] = -1
    w = torch.rand(5, 3, generator=g, dtype=torch.float64).float().double()
    return {"x": x, "w": w, "idx": idx}


def _float64(case: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(5, 16, dtype=torch.float64)
    for t in range(5):
        for k in range(3):
            if case["idx"][t, k] >= 0:
                out[t] += case["w"][t, k] * case["x"][case["idx"][t, k]]
    return out


def test_reference_sums_in_order_and_skips_empty_slots() -> None:
    schedule = parse_text(text())
    case = _case(1)
    case["idx"][2, 2] = -1
    case["x"][0] = float("nan")  # read only through empty slots below: must not leak
    case["idx"][case["idx"] == 0] = -1
    out = simulate_call(schedule, 2, SIZES, [dict(case), dict(case)], external=None)  # type: ignore[arg-type]
    want = _float64(case).to(torch.bfloat16).double()
    assert torch.equal(out[0]["out"], want) and not bool(want.isnan().any())


def test_reference_refuses_an_index_past_the_rows() -> None:
    schedule = parse_text(text())
    case = _case(2)
    case["idx"][1, 1] = 7
    with pytest.raises(ValueError, match="index holds a row past the 7 rows of x"):
        simulate_call(schedule, 2, SIZES, [case, case], external=None)  # type: ignore[arg-type]


def test_torch_backend_matches_float64_and_refuses_a_bad_index() -> None:
    from dcpc.runtime import collectives
    from dcpc.runtime.errors import DcpcArgumentError

    case = _case(3)
    dst = torch.full((5, 16), float("nan"), dtype=torch.bfloat16)
    x, w, idx = case["x"].bfloat16(), case["w"].float(), case["idx"].int()
    collectives.weighted_combine(x, w, idx, dst, "combine")
    want = _float64(case)
    assert ((dst.double() - want).abs() / (1 + want.abs())).max() <= 1e-2
    idx[4, 0] = 9
    with pytest.raises(DcpcArgumentError, match="index of token 4 holds row 9, past the 7 rows"):
        collectives.weighted_combine(x, w, idx, dst, "combine")
    far = case["idx"].long()
    far[1, 2] = 2**33 + 5  # the torch path names the i64 row as it is
    with pytest.raises(DcpcArgumentError, match="token 1 holds row 8589934597, past the 7"):
        collectives.weighted_combine(x, w, far, dst, "combine")


def test_torch_backend_fuses_each_term() -> None:
    """acc = fma(w, row, acc): the product and the sum rounded once (DeepEP's FFMA), not the
    product rounded to fp32 before the sum. Values where the two differ: w * row needs
    more than 24 bits, and the running sum keeps the bits the product's rounding drops."""
    from dcpc.runtime import collectives

    w = torch.tensor([[1.0, 1.0 + 2**-23]], dtype=torch.float32)
    x = torch.tensor([[-(1.0 + 2**-22)], [1.0 + 2**-23]], dtype=torch.float32)
    idx = torch.tensor([[0, 1]], dtype=torch.int32)
    dst = torch.zeros(1, 1, dtype=torch.float32)
    collectives.weighted_combine(x, w, idx, dst, "combine")
    exact = (-(1.0 + 2**-22)) + (1.0 + 2**-23) ** 2  # = 2**-46, representable in fp32
    assert float(dst) == exact == 2**-46
    unfused = torch.tensor(-(1.0 + 2**-22), dtype=torch.float32) + (w[0, 1] * x[1, 0])
    assert float(unfused) == 0.0  # the product alone rounds 2**-46 away


def _kernel_child() -> None:
    import tempfile

    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.local import LocalGroup

    def rank_main(rank: Any, path: str) -> dict[str, Any]:
        module = load_module_class(path, "wc")(rank, sizes={"T": 5}, device="cpu",
                                               backend="local", timeout_s=20, poison=True)
        case = _case(4 + rank.rank)
        got = module.combine(case["x"].bfloat16(), case["w"].float(), case["idx"].int())
        want = _float64(case)  # bf16 off by one rounding: relative, as dcpc run's tolerance
        err = float(((got.double() - want).abs() / (1 + want.abs())).max())
        report: dict[str, Any] = {"err": err, "nan": bool(got.isnan().any())}
        bad = case["idx"].int()
        bad[2, 1] = 8
        try:
            module.combine(case["x"].bfloat16(), case["w"].float(), bad)
            report["bad"] = "no error"
        except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
            report["bad"] = f"{type(exc).__name__}: {exc}"
        module.close()
        # an i64 index past i32: the row the error names is saturated, never wrapped
        wide = load_module_class(path64, "wc")(rank, sizes={"T": 5}, device="cpu",
                                               backend="local", timeout_s=20, poison=True)
        far = case["idx"].long()
        far[3, 2] = 2**33 + 5  # wrapped into i32: row 5, a row of x
        try:
            wide.combine(case["x"].bfloat16(), case["w"].float(), far)
            report["far"] = "no error"
        except Exception as exc:  # noqa: BLE001
            report["far"] = f"{type(exc).__name__}: {exc}"
        wide.close()
        return report

    with tempfile.TemporaryDirectory(prefix="dcpc-wc-") as tmp:
        src = Path(tmp) / "wc.yaml"
        src.write_text(text())
        _, module, _, _ = compile_to(str(src), Path(tmp), 2)
        (Path(tmp) / "i64").mkdir()
        src64 = Path(tmp) / "i64" / "wc.yaml"
        src64.write_text(text(idx="i64"))
        _, path64, _, _ = compile_to(str(src64), Path(tmp) / "i64", 2)
        print("RESULT " + json.dumps(LocalGroup(2, "cpu", timeout_s=60).run(rank_main, module)))


@pytest.mark.e2e
def test_kernel_matches_float64_and_refuses_a_bad_index() -> None:
    env = script_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "kernel"], capture_output=True,
                          text=True, timeout=300, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    reps = json.loads(lines[-1][len("RESULT "):])
    for rank, rep in enumerate(reps):
        assert not rep["nan"], rep  # row 6 is NaN: never read (no index names it)
        assert rep["err"] <= 1e-2, rep  # fp32 sum, one bf16 rounding
        # its own bad index, or (the peer raised first: its flag is seen in a wait) the
        # peer's failure; never data
        assert rep["bad"].startswith(f"DcpcArgumentError: step 'combine': rank {rank}'s index "
                                     "of token 2 holds row 8, past the 7 rows of x") or \
            rep["bad"].startswith("DcpcPeerFailedError: step 'combine'"), rep
        assert rep["far"].startswith(f"DcpcArgumentError: step 'combine': rank {rank}'s index "
                                     "of token 3 holds row >= 2147483647, past the 7 rows") or \
            rep["far"].startswith("DcpcPeerFailedError: step 'combine'"), rep
    assert any(rep["bad"].startswith("DcpcArgumentError") for rep in reps), reps
    assert any(rep["far"].startswith("DcpcArgumentError") for rep in reps), reps


if __name__ == "__main__" and sys.argv[1:] == ["kernel"]:
    _kernel_child()


def _stacked() -> str:
    return text(w_shape="[T, 1, K]", out_shape="[T, 1, H]").replace(
        "idx: {shape: [T, K]", "idx: {shape: [T, 1, K]")


def test_tokens_may_span_several_dims(tmp_path: Path) -> None:
    """weights and index [*T, K], dst [*T, H] (DeepEP normal mode's forwarder reduces into
    its [N, C, H] RDMA send blocks): the same sums as [T, K]; a dst whose token dims
    differ from the weights' is refused (it was refused for any weights of 3 dims)."""
    assert codes(_stacked(), tmp_path, "wc.yaml") == []
    bad = _stacked().replace("out: {shape: [T, 1, H]", "out: {shape: [T, H]")
    assert codes(bad, tmp_path, "wc.yaml") == ["shape-mismatch"]
    case = _case(3)
    stacked = {"x": case["x"], "w": case["w"].reshape(5, 1, 3),
               "idx": case["idx"].reshape(5, 1, 3)}
    out = simulate_call(parse_text(_stacked()), 2, SIZES, [stacked, stacked],  # type: ignore[arg-type]
                        external=None)
    want = _float64(case).to(torch.bfloat16).double().reshape(5, 1, 16)
    assert torch.equal(out[0]["out"], want)
    from dcpc.runtime import collectives

    dst = torch.zeros(5, 1, 16, dtype=torch.bfloat16)
    collectives.weighted_combine(case["x"].bfloat16(), stacked["w"].float(),
                                 stacked["idx"].int(), dst, "combine")
    assert torch.equal(dst.double(), want)
