"""Every shipped schedule, compiled and run across processes on both CPU backends.

Each configuration runs 50 calls per rank with poisoned symmetric memory, random
delays around every step, slot 1 before slot 0, empty KV shards, CUDA-graph padding
rows and NaN/inf garbage in empty partials; every output of every call on every
rank must match the float64 simulation of the schedule.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from dcpc.harness.run import RunConfig, format_report, run_schedule

SCHEDULES = Path(__file__).resolve().parent.parent / "schedules"
SHIPPED = sorted(p.stem for p in SCHEDULES.glob("*.yaml"))
CALLS = 50

pytestmark = pytest.mark.e2e


def _run(config: RunConfig) -> None:
    report = run_schedule(config)
    text = format_report(report)
    print(text)
    assert report.launch.ok, text + "\n" + "\n".join(o.traceback for o in report.launch.outcomes)
    assert report.mismatches == 0, text
    for name, stats in report.outputs.items():
        assert stats.compared == config.calls * config.world, (name, text)


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", SHIPPED)
def test_shipped_schedule_matches_float64_reference(schedule: str, world: int,
                                                    backend: str) -> None:
    seed = zlib.crc32(f"{schedule}/{world}/{backend}".encode()) % 10_000
    _run(RunConfig(schedule=str(SCHEDULES / f"{schedule}.yaml"), world=world, backend=backend,
                   calls=CALLS, seed=seed))


@pytest.mark.parametrize("schedule", ["kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_ag_rs"])
def test_two_slots_in_flight_interleaved(schedule: str) -> None:
    _run(RunConfig(schedule=str(SCHEDULES / f"{schedule}.yaml"), world=2, backend="host",
                   calls=20, seed=11, order="interleaved"))


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("schedule", ["kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_ag_rs"])
def test_base2_lse_variant(schedule: str, backend: str) -> None:
    _run(RunConfig(schedule=str(SCHEDULES / f"{schedule}.yaml"), world=2, backend=backend,
                   calls=20, seed=23, lse_base="2"))
