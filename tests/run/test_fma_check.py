"""benchmarks/fma_check.py on CPU (Triton's interpreter, ranks as threads through
``local``): it compiles its one-step weighted_combine schedule, runs it, and classes the
kernel's fp32 output against its two references. The interpreter computes tl.fma as a
numpy product and sum, so there every element equals the unfused reference; the inputs
must make the references differ, or the verdict would say nothing (on the GPU it is
"fused": benchmarks/results/fma_check_*.json). A smoke test of the script the lead runs
on a GPU, not a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fma_check_on_the_interpreter_says_unfused(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.fma_check", "--device", "cpu",
                           "--tokens", "4", "--hidden", "64", "--seeds", "2",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "fma_check.json").read_text())
    assert result == json.loads(done.stdout)
    assert result["interpreter"] is True and result["verdict"] == "unfused"
    runs = result["runs"]
    assert sorted((r["seed"], r["rank"]) for r in runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in runs:
        assert r["elements"] == 4 * 64 and r["equal_unfused"] == r["elements"], r
        assert 0 < r["references_differ"] == r["elements"] - r["equal_fused"], r
