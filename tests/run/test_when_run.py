"""`dcpc run` of rank-dependent steps (`when:`) on the torch backend (gloo): the host
backend runs them in tests/cli/test_gallery.py (zigzag at W 2, 3, 4) and
tests/ops/test_op_schedules.py (schedules/ops/when.yaml at W 2, 3). Every output matches
float64, and each guarded engine step's reads are compared on exactly the ranks where its
condition holds (the module's runs() and the reference agree on where it runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.gallery import CALLS

from dcpc.harness.run import RunConfig, format_report, run_schedule

ROOT = Path(__file__).resolve().parents[2]
ZIGZAG = ROOT / "schedules" / "gallery" / "zigzag_ring_attention.yaml"
OPS_WHEN = ROOT / "schedules" / "ops" / "when.yaml"


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_runs_on_torch_against_float64(world: int) -> None:
    report = run_schedule(RunConfig(schedule=str(ZIGZAG), world=world, backend="torch",
                                    calls=CALLS, seed=33))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    # ring step s = h + 1: the upper branch (s > r) on ranks 0..s-1, the lower (s <= r)
    # on ranks s..W-1; the last step (s = W - 1) likewise
    for h in range(world - 2):
        s, slot = h + 1, 2 * (h % 2)  # hop h reads the block in recv[2 * (h % 2)]
        assert report.outputs[f"recv_{slot}@attend_upper_h{h}"].compared == CALLS * s, text
        assert report.outputs[f"recv_{slot}@attend_lower_h{h}"].compared == CALLS * (
            world - s), text
    s = world - 1
    slot = 2 * ((world - 2) % 2)
    assert report.outputs[f"recv_{slot}@attend_upper_last"].compared == CALLS * s, text
    assert report.outputs[f"recv_{slot}@attend_lower_last"].compared == CALLS * (world - s)


@pytest.mark.e2e
def test_guarded_kernels_run_on_torch_against_float64() -> None:
    """schedules/ops/when.yaml: a guarded copy, sum and merges return without launching
    on the odd ranks; what they return there is what they held (nothing to compare)."""
    report = run_schedule(RunConfig(schedule=str(OPS_WHEN), world=3, backend="torch",
                                    calls=CALLS, seed=33))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    # ranks 0 and 2 run every step (rank < W - 1 keeps sum off rank 2), rank 1 none
    assert report.outputs["x_copy"].compared == CALLS * 2, text
    assert report.outputs["y"].compared == CALLS * 1, text
    assert report.outputs["out"].compared == CALLS * 2, text
