"""ragged_all_to_all (dcpc/ops/ragged_all_to_all.py): the verifier's refusals, the float64
reference (rows past a count are NaN; counts travel), the torch backend's collective, the
kernel's over-capacity error (ranks as threads: the ``local`` backend on CPU), and the
happens-before checker against the brute force (tests/support/hb_oracle.py) and the execution
oracle. The layout end to end is tests/cli/test_gallery.py's moe_dispatch_combine.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import child_result
from support.exec_oracle_agree import assert_three_agree, disagreements
from support.hb_oracle import oracle_keys
from support.schedules import codes

from dcpc.check import hb
from dcpc.harness.simulate import seen_at, simulate_call, unsent_at
from dcpc.harness.worker import OutputStats, compare
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]

BASE = """\
schedule: rag
slots: {slots}
sizes: {{C: {{max: 4}}, H: 8}}
buffers:
  x_send: {{shape: [W, C, H], dtype: {src}}}
  counts: {{shape: [W], dtype: {counts}}}
  x_recv: {{shape: {dst_shape}, dtype: {dst}{sym}}}
  n_recv: {{shape: [W], dtype: {recv}, symmetric: true}}
  y:      {{shape: [W, C, H], dtype: bf16}}
steps:
  - dispatch: {{op: ragged_all_to_all, src: x_send, dst: x_recv, counts: counts,
               recv_counts: n_recv, capacity: {cap}}}
{tail}"""
SAFE_TAIL = """\
  - experts: {op: external, reads: [x_recv, n_recv], writes: [y]}
  - done:    {op: barrier}
"""


def text(**kw: Any) -> str:
    spec = {"slots": 1, "src": "bf16", "counts": "i32", "dst_shape": "[W, C, H]",
            "dst": "bf16", "sym": ", symmetric: true", "recv": "i32", "cap": "C",
            "tail": SAFE_TAIL, **kw}
    return BASE.format(**spec)


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"sym": ""}, ["not-symmetric"]),
    ({"dst_shape": "[W, C + 1, H]"}, ["shape-mismatch"]),
    ({"cap": "C + 1"}, ["shape-mismatch"]),
    ({"counts": "f32"}, ["bad-counts"]),
    ({"recv": "i64"}, ["bad-counts"]),
    ({"src": "i32", "dst": "i32"}, []),  # an integer payload (expert ids) moves as is
    ({"src": "i64", "dst": "i32"}, ["dtype-mismatch"]),
    ({"dst": "f32"}, ["dtype-mismatch"]),
    ({"dst": "fp8e4m3"}, ["dtype-mismatch"]),  # a cast needs its scale (docs/language.md)
])
def test_verifier(change: dict[str, str], want: list[str], tmp_path: Path) -> None:
    assert codes(text(**change), tmp_path, "rag.yaml", (2, 3, 4)) == want


def _inputs(world: int, cap: int, counts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(world)
    return [{"x_send": torch.randn(world, cap, 8, generator=g, dtype=torch.float64)
             .to(torch.bfloat16).double(),
             "counts": torch.tensor(counts[p], dtype=torch.int64)} for p in range(world)]


def test_reference_moves_live_rows_and_poisons_the_rest() -> None:
    schedule = parse_text(text(tail=""))
    counts = [[2, 0, 4], [4, 1, 3], [0, 3, 2]]
    inputs = _inputs(3, 4, counts)
    out = simulate_call(schedule, 3, {"C": 4, "H": 8}, inputs, external=None)  # type: ignore[arg-type]
    for j in range(3):
        assert out[j]["n_recv"].tolist() == [counts[p][j] for p in range(3)]
        for p in range(3):
            n = counts[p][j]
            assert torch.equal(out[j]["x_recv"][p, :n], inputs[p]["x_send"][j, :n])
            assert bool(out[j]["x_recv"][p, n:].isnan().all())  # never sent: poison


def test_a_nan_a_rank_sent_is_compared_only_unsent_rows_are_left_out() -> None:
    """Rank 1 sends a NaN in a live row: a run whose kernel lost it (0.0 there) is a
    mismatch; only the rows past a count are left out. The comparison skipped every
    NaN of the reference, a sent one too (NaN never passes as a number)."""
    schedule = parse_text(text(tail=""))
    counts = [[2, 0], [3, 1]]
    inputs = _inputs(2, 4, counts)
    inputs[1]["x_send"][0, 1, 5] = math.nan  # a live row of rank 1's part for rank 0
    trace: list = []
    simulate_call(schedule, 2, {"C": 4, "H": 8}, inputs, external=None,  # type: ignore[arg-type]
                  trace=trace)
    want = seen_at(trace, 1, 0, "x_recv")
    unsent = unsent_at(trace, 1, 0, "x_recv")
    assert want is not None and unsent is not None
    assert unsent[:, :, 0].tolist() == [[False, False, True, True], [False] * 3 + [True]]
    lost = torch.where(torch.isnan(want), torch.zeros_like(want), want)  # garbage where unsent
    stats = OutputStats()
    compare("x_recv", "move", "bf16", lost, want, stats, "here", unsent=unsent)
    assert stats.mismatches == 1 and "[1, 1, 5]" in stats.first_mismatch, stats.first_mismatch
    kept = torch.where(unsent, torch.zeros_like(want), want)  # the NaN moved; rows stale
    stats = OutputStats()
    compare("x_recv", "move", "bf16", kept, want, stats, "here", unsent=unsent)
    assert stats.mismatches == 0


def test_reference_refuses_a_count_over_capacity() -> None:
    schedule = parse_text(text(tail=""))
    inputs = _inputs(2, 4, [[4, 5], [0, 0]])
    with pytest.raises(ValueError, match=r"counts\[1\] = 5 is outside \[0, capacity 4\]"):
        simulate_call(schedule, 2, {"C": 4, "H": 8}, inputs, external=None)  # type: ignore[arg-type]


def test_torch_backend_collective_on_one_rank() -> None:
    """The torch backend's ragged move (W = 1: the collective is a copy): live rows only,
    the count alongside, and a count over capacity raises before anything moves."""
    from dcpc.runtime import collectives
    from dcpc.runtime.errors import DcpcArgumentError

    comm = collectives.SlotGroup(None, 0, 0, None)
    src = torch.randn(1, 4, 3, dtype=torch.bfloat16)
    dst = torch.full((1, 4, 3), math.nan, dtype=torch.bfloat16)
    got = torch.zeros(1, dtype=torch.int32)
    collectives.ragged_all_to_all(comm, src, torch.tensor([3]), dst, got, 4, 1, "dispatch")
    assert got.tolist() == [3] and torch.equal(dst[0, :3], src[0, :3])
    assert bool(dst[0, 3].isnan().all())
    with pytest.raises(DcpcArgumentError, match=r"step 'dispatch': rank 0's counts\[0\] = 5, "
                       r"over the capacity 4"):
        collectives.ragged_all_to_all(comm, src, torch.tensor([5]), dst, got, 4, 1, "dispatch")


RACE_TAIL = """\
  - experts: {op: external, reads: [x_recv, n_recv], writes: [y]}
"""
CASES = {
    "safe": (text(), set()),
    # the next call's dispatch overwrites x_recv/n_recv before the experts read them
    "reuse": (text(tail=RACE_TAIL), {("race", "write-after-read", "x_recv", "experts",
                                      "dispatch"),
                                     ("race", "write-after-read", "n_recv", "experts",
                                      "dispatch"),
                                     # the receiver's count check after the wait too
                                     ("race", "write-after-read", "n_recv", "dispatch",
                                      "dispatch"),
                                     # and the engine's read of what dispatch returns
                                     ("race", "write-after-read", "x_recv", "dispatch",
                                      "dispatch")}),
    "two_slots": (text(slots=2), set()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checker_agrees_with_brute_force_and_execution(case: str) -> None:
    source, want = CASES[case]
    schedule = parse_text(source)
    assert_three_agree(schedule, want, case)


def _over_capacity_child() -> None:
    """W = 2 ranks as threads: rank 0 routes 5 rows to rank 1 under capacity 4."""
    import tempfile

    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.local import LocalGroup

    def rank_main(rank: Any, path: str) -> str:
        module = load_module_class(path, "rag")(rank, sizes={"C": 4}, device="cpu",
                                                backend="local", timeout_s=20)
        x = torch.randn(2, 4, 8).bfloat16()
        counts = torch.tensor([1, 5 if rank.rank == 0 else 2], dtype=torch.int32)
        try:
            module.dispatch(x, counts)
        except Exception as exc:  # noqa: BLE001 (the test reads what each rank raised)
            return f"{type(exc).__name__}: {exc}"
        finally:
            module.close()
        return "no error"

    with tempfile.TemporaryDirectory(prefix="dcpc-rag-") as tmp:
        src = Path(tmp) / "rag.yaml"
        src.write_text(text(tail=""))
        _, module, _, _ = compile_to(str(src), Path(tmp), 2)
        print("RESULT " + json.dumps(LocalGroup(2, "cpu", timeout_s=60).run(rank_main, module)))


@pytest.mark.e2e
def test_count_over_capacity_raises_in_the_kernel() -> None:
    ranks = child_result(__file__, "over")
    assert ranks[0].startswith("DcpcArgumentError: step 'dispatch': rank 0's counts[1] = 5, "
                               "over the capacity 4; no row of that part was sent"), ranks
    # the receiver finds the count (the flag) after its wait: never a silent short part;
    # where rank 0 raised first, its failure flag is seen before the count
    assert ranks[1].startswith("DcpcArgumentError: step 'dispatch': peer 0 routed 5 rows to "
                               "rank 1, over the capacity 4") or ranks[1].startswith(
        "DcpcPeerFailedError: step 'dispatch': rank 1 stopped waiting for peer 0"), ranks


if __name__ == "__main__" and sys.argv[1:] == ["over"]:
    _over_capacity_child()


GALLERY = ROOT / "schedules" / "gallery" / "moe_dispatch_combine.yaml"
TWIN = ROOT / "tests" / "gallery_twins" / "moe_dispatch_combine.shared_recv.yaml"


@pytest.mark.parametrize("path", [GALLERY, TWIN], ids=["gallery", "shared_recv"])
def test_moe_layout_checker_agrees_with_brute_force_and_execution(path: Path) -> None:
    """The MoE gallery layout (no race: each exchange orders the other's receive
    buffers) and its twin with one receive buffer for both microbatches (races):
    the checker, the brute force and the execution oracle say the same."""
    schedule = parse_text(path.read_text(), str(path))
    for world in (2, 3):
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world), (path.name, world)
        assert bool(found) == (path == TWIN), found
    assert disagreements(schedule, [2, 3]) == [], path.name


@pytest.mark.e2e
def test_moe_layout_on_the_torch_backend_matches_float64() -> None:
    """The torch backend's collectives (gloo, one process per rank) on the gallery layout:
    the fp8 dispatch with its scales, the bf16 return trip (each row at its token's
    index, no count back) and the combine."""
    from dcpc.harness.run import RunConfig, format_report, run_schedule

    report = run_schedule(RunConfig(schedule=str(GALLERY), world=2, backend="torch", calls=4,
                                    seed=7))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert {"x_recv", "layout", "y_back", "out"} <= set(report.outputs), text


def test_the_receivers_count_check_after_the_wait_is_a_read_of_recv_counts() -> None:
    """Review finding: after its wait the kernel reads every peer's count in recv_counts
    (the over-capacity check); the row omitted that read, so a shared recv_counts
    rewritten by the next call was proved clean. Now a write-after-read race, in the
    checker and in the brute force."""
    text = """
schedule: rg3
slots: 2
streams: single
sizes: {C: 4, H: 8}
buffers:
  x_send: {shape: [W, C, H], dtype: bf16}
  counts: {shape: [W], dtype: i32}
  x_recv: {shape: [W, C, H], dtype: bf16, symmetric: true}
  n_recv: {shape: [W], dtype: i32, symmetric: true, shared: true}
  y:      {shape: [W, C, H], dtype: bf16}
steps:
  - dispatch: {op: ragged_all_to_all, src: x_send, dst: x_recv, counts: counts,
               recv_counts: n_recv, capacity: C}
  - use: {op: external, reads: [x_recv], writes: [y]}
"""
    schedule = parse_text(text, "rg3.yaml")
    found = {f.key[:3] for f in hb.check(schedule, range(2, 5)).findings}
    assert ("race", "write-after-read", "n_recv") in found, found
    assert any(k[:3] == ("race", "write-after-read", "n_recv")
               for k in oracle_keys(schedule, 3)), "the brute force misses it"
