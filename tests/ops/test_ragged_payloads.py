"""ragged_all_to_all with several payloads (`src: [x, ids, w]`, issue 33): one count set
moves the same rows of every payload in one kernel; a cast applies to the first payload
only, the others (integer expert ids, f32 weights) move bit for bit. The verifier's
refusals, the float64 reference by hand, the checker against the brute force and the
execution oracle on a racy twin, the torch collective, and the conformance file on the
kernels (ranks as threads) and gloo against float64."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.exec_oracle_agree import assert_three_agree
from support.schedules import codes

from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import UNSENT_INT, simulate_call
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "ops" / "ragged_all_to_all_multi.yaml"

BASE = """\
schedule: multi
slots: {slots}
sizes: {{C: {{max: 4}}, H: 8, K: 2}}
buffers:
  x:   {{shape: [W, C, H], dtype: bf16}}
  ids: {{shape: {ids_shape}, dtype: {ids}}}
  n:   {{shape: [W], dtype: i32}}
  xr:  {{shape: [W, C, H], dtype: {xr}, symmetric: true}}
  ir:  {{shape: [W, C, K], dtype: {ir}, symmetric: true}}
  s:   {{shape: [W, C], dtype: f32, symmetric: true}}
  m:   {{shape: [W], dtype: i32, symmetric: true}}
  o:   {{shape: [W, C, H], dtype: bf16}}
steps:
  - move: {{op: ragged_all_to_all, src: {src}, dst: {dst}, counts: n, recv_counts: m,
           capacity: C{scale}}}
{tail}"""
USE = "  - use: {op: external, reads: [xr, ir, m, s], writes: [o]}\n"
SAFE = USE + "  - free: {op: barrier}\n"


def text(**kw: Any) -> str:
    spec = {"slots": 1, "ids_shape": "[W, C, K]", "ids": "i32", "xr": "fp8e4m3", "ir": "i32",
            "src": "[x, ids]", "dst": "[xr, ir]", "scale": ", scale: {per: token, buffer: s}",
            "tail": SAFE, **kw}
    return BASE.format(**spec)


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"src": "[x, ids]", "dst": "[xr]"}, ["list-length-mismatch", "read-before-write"]),
    ({"ids_shape": "[W, C + 1, K]"}, ["shape-mismatch"]),  # every payload: capacity rows
    ({"ids": "i64"}, ["dtype-mismatch"]),  # ids move as they are
    ({"ids": "f32", "ir": "fp8e4m3"}, ["dtype-mismatch"]),  # the cast is the first's only
    # the cast is not the first payload's: refused (and its scales are then never written)
    ({"src": "[ids, x]", "dst": "[ir, xr]"}, ["bad-cast", "dtype-mismatch",
                                              "read-before-write"]),
])
def test_verifier(change: dict[str, str], want: list[str], tmp_path: Path) -> None:
    assert codes(text(**change), tmp_path, "multi.yaml", (2, 3)) == want


def test_a_second_payload_that_changes_dtype_is_told_the_first_is_cast(tmp_path: Path) -> None:
    from dcpc.check import structural

    schedule = parse_text(text(ids="f32", ir="fp8e4m3"), "multi.yaml")
    (err,) = [d for d in structural.check(schedule, [2]) if d.severity == "error"]
    assert "'scale' casts the first payload only" in (err.hint or ""), err


def test_reference_moves_every_payload_by_the_one_count() -> None:
    schedule = parse_text(text(tail="", xr="bf16", scale=""), "multi.yaml")
    counts = [[2, 0, 4], [4, 1, 3], [0, 3, 2]]
    g = torch.Generator().manual_seed(1)
    inputs = [{"x": torch.randn(3, 4, 8, generator=g).bfloat16().double(),
               "ids": torch.randint(-2**31, 2**31 - 1, (3, 4, 2), generator=g),
               "n": torch.tensor(counts[p])} for p in range(3)]
    out = simulate_call(schedule, 3, {"C": 4, "H": 8, "K": 2}, inputs,  # type: ignore[arg-type]
                        external=None)
    for j in range(3):
        assert out[j]["m"].tolist() == [counts[p][j] for p in range(3)]
        for p in range(3):
            n = counts[p][j]
            assert torch.equal(out[j]["xr"][p, :n], inputs[p]["x"][j, :n])
            assert torch.equal(out[j]["ir"][p, :n].long(), inputs[p]["ids"][j, :n])
            assert bool((out[j]["ir"][p, n:] == UNSENT_INT).all())
            assert bool(out[j]["xr"][p, n:].isnan().all())


CASES = {
    "safe": (text(), set()),
    # without the barrier the next call's push into ir (as into xr, s, m) races the use
    "reuse": (text(tail=USE), {("race", "write-after-read", b, "use", "move")
                               for b in ("xr", "ir", "s", "m")}
              | {("race", "write-after-read", "m", "move", "move")}
              # the engine reads what move returns, at its return
              | {("race", "write-after-read", b, "move", "move") for b in ("xr", "ir")}),
    "two_slots": (text(slots=2), set()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checker_agrees_with_brute_force_and_execution(case: str) -> None:
    source, want = CASES[case]
    schedule = parse_text(source)
    assert_three_agree(schedule, want, case)


def test_torch_collective_moves_the_other_payloads_as_they_are() -> None:
    from dcpc.runtime import collectives

    comm = collectives.SlotGroup(None, 0, 0, None)
    x, ids = torch.randn(1, 4, 3), torch.tensor([[[2**40 + 1], [-5], [7], [9]]])
    dst = torch.full((1, 4, 3), math.nan)
    ids_dst = torch.full((1, 4, 1), -1, dtype=torch.int64)
    got = torch.zeros(1, dtype=torch.int32)
    collectives.ragged_all_to_all(comm, x, torch.tensor([2]), dst, got, 4, 1, "move",
                                  more=[(ids, ids_dst)])
    assert ids_dst.reshape(-1).tolist() == [2**40 + 1, -5, -1, -1]
    assert torch.equal(dst[0, :2], x[0, :2]) and bool(dst[0, 2:].isnan().all())


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [(2, "torch"), (3, "torch"), (2, "local"),
                                                (3, "local")])
def test_the_file_matches_float64(world: int, backend: str) -> None:
    """The host backend runs it in tests/ops/test_op_schedules.py."""
    report = run_schedule(RunConfig(schedule=str(FILE), world=world, backend=backend, calls=3,
                                    seed=3))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    for name in ("x_recv", "s_recv", "ids_recv", "w_recv", "y_back", "tag_back"):
        assert report.outputs[name].compared == 3 * world, (name, text)
