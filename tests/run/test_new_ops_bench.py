"""benchmarks/new_ops.py on CPU (--dry-run: Triton interpreter, ranks as threads through
``local``): it compiles its four schedules, runs every op, its barrier and the torch
baseline, and writes its table and JSON. A smoke test of the benchmark the lead runs on
a GPU, not a timing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_new_ops_bench_dry_run_prints_its_table(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.new_ops", "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "new_ops.json").read_text())
    records = result["records"]
    assert [(r["op"], r["world"]) for r in records] == [
        ("all_reduce", 2), ("broadcast", 2), ("all_to_all", 2), ("shift", 2)]
    for r in records:
        for key in ("dcpc_us", "barrier_us", "torch_us"):
            assert math.isfinite(r[key]) and r[key] > 0, r
    table = (tmp_path / "new_ops.md").read_text()
    assert table.startswith("| op | W |") and table in done.stdout
    assert table.count("\n") == 2 + len(records)
