"""The ``local`` backend on CPU: W ranks as threads of one process (Triton interpreter).

Every shipped schedule at W = 2 and 4 through ``dcpc run --backend local`` (the harness's
ranks as threads of one child process): poisoned symmetric memory, seeded delays around
every step, slots in flight interleaved, empty shards, padding rows and NaN/inf garbage in
empty partials; every value a method returns is compared with the float64 simulation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from support import script_env

from dcpc.harness.run import RunConfig, format_report, run_schedule

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"
SHIPPED = sorted(p.stem for p in SCHEDULES.glob("*.yaml"))

pytestmark = pytest.mark.e2e


def _fail_child() -> None:
    from dcpc.runtime.local import LocalGroup, LocalRankError

    def body(rank: Any) -> None:
        if rank.rank == 1:
            raise ValueError("rank 1 gives up")
        rank.barrier()

    try:
        LocalGroup(3, "cpu", timeout_s=30).run(body)
    except LocalRankError as exc:
        print("RESULT " + json.dumps(str(exc)))


def _run_child(*args: str, timeout: float = 420) -> Any:
    env = script_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SHIPPED)
def test_local_threads_match_float64(schedule: str, world: int) -> None:
    calls = 6 if world == 2 else 4
    seed = zlib.crc32(f"local/{schedule}/{world}".encode()) % 10_000
    order = "interleaved" if schedule != "kv_gather" else "sequential"
    report = run_schedule(RunConfig(schedule=str(SCHEDULES / f"{schedule}.yaml"), world=world,
                                    backend="local", calls=calls, seed=seed, order=order))
    text = format_report(report)
    assert report.launch.ok, text + "\n" + "\n".join(o.traceback for o in report.launch.outcomes)
    assert len(report.ranks) == world and report.mismatches == 0, text
    for name, stats in report.outputs.items():
        assert stats.compared == calls * world, (name, text)


def test_local_rank_failure_is_reported_not_hung() -> None:
    """A rank that raises breaks the group: the others stop at their barrier, and the
    error names the rank and its exception."""
    text = _run_child("--fail", timeout=120)
    assert "rank 1 failed" in text and "rank 1 gives up" in text, text


def test_local_program_cap_on_cpu() -> None:
    import torch

    from dcpc.runtime.local import CPU_PROGRAMS, program_cap

    assert program_cap(torch.device("cpu"), 8, 2) == CPU_PROGRAMS


if __name__ == "__main__":
    if sys.argv[1] == "--fail":
        _fail_child()
        sys.exit(0)
    raise SystemExit(f"unknown argument {sys.argv[1]!r}")
