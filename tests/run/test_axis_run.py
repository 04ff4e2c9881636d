"""`dcpc run` of a buffer sliced along a later axis (``s[:, k]``): external steps write
its chunks, the module's copy takes it whole (the engine's tensor, whose chunks are
views ``s[:, k]`` of it) and an all_gather moves it; every rank's gathered output
matches float64 on the host backend (Triton interpreter, shared memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.schedules import run_clean, write

TEXT = """\
schedule: axis_run
sizes: {B: {max: 2}, C: 4, D: 8}
buffers:
  q: {shape: [B, 2, C, D], dtype: bf16}
  y0: {shape: [B, C, D], dtype: bf16}
  y1: {shape: [B, C, D], dtype: bf16}
  s: {shape: [B, 2, C, D], dtype: bf16}
  g: {shape: [B, 2, C, D], dtype: bf16, symmetric: true}
  h: {shape: [W, B, 2, C, D], dtype: bf16, symmetric: true}
steps:
  - lower: {op: external, reads: ["q[:, 0]"], writes: [y0]}
  - upper: {op: external, reads: ["q[:, 1]"], writes: [y1]}
  - chunks: {op: external, reads: [y0, y1], writes: ["s[:, 0]", "s[:, 1]"]}
  - whole: {op: copy, src: s, dst: g}
  - gather: {op: all_gather, src: g, dst: h}
  - done: {op: barrier}
"""


@pytest.mark.e2e
def test_chunks_written_by_the_engine_reach_the_module_as_its_whole_tensor(
        tmp_path: Path) -> None:
    path = write(tmp_path, TEXT, "axis_run.yaml")
    report, text = run_clean(schedule=str(path), world=2, backend="host", calls=3)
    assert report.outputs["h"].compared == 3 * 2, text
    assert report.outputs["g"].compared == 3 * 2, text
