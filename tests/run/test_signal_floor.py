"""benchmarks/signal_floor.py on CPU (Triton interpreter, ranks as threads through
``local``): both floor kernels run at W = 2..8, every rank's epochs advance once per
launch and no wait records an error, and the JSON result is well-formed. A smoke test of
the benchmark the lead runs on a GPU, not a timing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_signal_floor_runs_on_cpu_and_prints_its_result(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.signal_floor", "--worlds", "2,3,4,5,8",
         "--iters", "2", "--reps", "1", "--timeout", "240", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result == json.loads((tmp_path / "signal_floor.json").read_text())
    assert result["ok"] is True
    assert [r["world"] for r in result["worlds"]] == [2, 3, 4, 5, 8]
    for row in result["worlds"]:
        assert row["epochs_ok"] and row["errors_ok"], row
        assert row["launches"] == 3, row  # bench() on CPU: one warm-up, reps x iters
        for kind in ("serial", "parallel"):
            assert math.isfinite(row[f"{kind}_us"]) and row[f"{kind}_us"] > 0, row
    for kind in ("serial", "parallel"):
        assert math.isfinite(result["slope_us_per_peer"][kind])
